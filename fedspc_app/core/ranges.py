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


# FedSPC and SCAFFOLD divide each update by E * eta in float32: eta and 1/eta must both
# be float32 numbers, else the clients' u_k come out infinite or NaN.
FLOAT32_MAX = 3.4028234663852886e38
LEARNING_RATE_RANGE = (1 / FLOAT32_MAX, FLOAT32_MAX)


def is_number(value: object) -> bool:
    """An int (not a bool) or a finite float; compared without converting an int to
    float (``math.isfinite(10**400)`` raises OverflowError)."""
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, int) and not isinstance(value, bool)


def usable_learning_rate(value: object) -> bool:
    """Whether ``value`` is a learning rate a client can train and divide by: an int or
    float (not a bool) within :data:`LEARNING_RATE_RANGE`."""
    low, high = LEARNING_RATE_RANGE
    return is_number(value) and low <= value <= high


def learning_rate_range_text() -> str:
    """The range of :func:`usable_learning_rate`, for error messages."""
    low, high = LEARNING_RATE_RANGE
    return f"a number from {low:.3g} to {high:.3g} (eta and 1/eta float32 numbers)"
