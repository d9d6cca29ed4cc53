"""The range and choice checks that run-config values go through (config.py and
privacy_config.py share them, so that every key's error reads the same)."""

from __future__ import annotations

import math

from fedspc_app.core.errors import ConfigError


def choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise ConfigError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ConfigError(
            f"run-config '{key}' = {value!r} is not one of: {', '.join(choices)}"
        )


def at_least(key: str, value: float, low: float, *, strict: bool = False) -> None:
    """Raise ConfigError unless ``value`` is finite and >= ``low`` (> with ``strict``)."""
    ok = value > low if strict else value >= low
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        relation = ">" if strict else ">="
        raise ConfigError(f"run-config '{key}' must be {relation} {low:g}, got {value!r}")
