"""Run-configs as users give them: the app's defaults, a TOML preset, ``--set`` pairs."""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedspc_app.core.errors import ConfigError

APP_DIR = Path(__file__).resolve().parents[2]
_PAIR = r"""[^\s=]+=(?:"(?:[^"\\]|\\.)*"|'[^']*'|[^\s"']+)"""
_ASSIGNMENTS = re.compile(rf"\s*{_PAIR}(?:\s+{_PAIR})*\s*")


def app_defaults(app_dir: Path = APP_DIR) -> dict[str, Any]:
    """The app's run-config defaults (``[tool.flwr.app.config]`` of pyproject.toml)."""
    return dict(read_toml(Path(app_dir) / "pyproject.toml")["tool"]["flwr"]["app"]["config"])


def absolute_paths(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """Make ``output-dir`` and ``data-dir`` absolute (relative to this process's cwd).

    The ServerApp and ClientApps resolve relative paths against their own working
    directory, which is the SuperLink's, not the caller's.
    """
    out = dict(run_config)
    for key in ("output-dir", "data-dir"):
        if out.get(key):
            out[key] = str(Path(str(out[key])).expanduser().resolve())
    return out


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as a dict; a missing or malformed file is a :class:`ConfigError`."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"run-config file {path} not found") from None
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"cannot read run-config file {path}: {error}") from None


def parse_assignments(text: str) -> dict[str, Any]:
    """``"a=1 b='x'"`` → ``{"a": 1, "b": "x"}`` (values are TOML), as ``flwr run`` reads them.

    Flower's parser drops a word without ``=`` silently; here every word must be a
    ``key=value`` pair.
    """
    from click import ClickException
    from flwr.common.config import parse_config_args

    if not text.strip():
        return {}
    if not _ASSIGNMENTS.fullmatch(text):
        raise ConfigError(f"overrides must be space-separated key=value pairs, got {text!r}")
    try:
        return dict(parse_config_args([text]))
    except ClickException as error:
        raise ConfigError(f"cannot parse overrides {text!r}: {error.message}") from None


def load_overrides(preset: str | Path | None = None, assignments: str = "") -> dict[str, Any]:
    """What a user asks for on a command line: the TOML ``preset``, then ``assignments``."""
    overrides = read_toml(preset) if preset else {}
    overrides.update(parse_assignments(assignments))
    return overrides


def check_resources(clients: int, client_cpus: float, client_gpus: float) -> None:
    """Simulation sizes: at least one client, CPUs > 0 and GPUs >= 0 per client."""
    problems = []
    if clients < 1:
        problems.append(f"clients must be >= 1, got {clients}")
    if not (client_cpus > 0 and math.isfinite(client_cpus)):
        problems.append(f"client-cpus must be > 0, got {client_cpus:g}")
    if not (client_gpus >= 0 and math.isfinite(client_gpus)):
        problems.append(f"client-gpus must be >= 0, got {client_gpus:g}")
    if problems:
        raise ConfigError("simulation settings out of range: " + "; ".join(problems))
