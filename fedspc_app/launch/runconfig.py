"""Run-configs as users give them: the app's defaults, a TOML preset, ``--set`` pairs."""

from __future__ import annotations

import contextlib
import math
import os
import re
import tempfile
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import tomli_w

from fedspc_app.core.config import RunConfig, parse_run_config
from fedspc_app.core.errors import ConfigError
from fedspc_app.core.files import expand_user

APP_DIR = Path(__file__).resolve().parents[2]
_KEY = r"[^\s=]+"
_VALUE = r"""(?:"(?:[^"\\]|\\.)*"|'[^']*'|[^\s"']+)"""
_PAIR_GROUPS = re.compile(rf"({_KEY})=({_VALUE})")
_ASSIGNMENTS = re.compile(rf"\s*{_KEY}={_VALUE}(?:\s+{_KEY}={_VALUE})*\s*")


@contextlib.contextmanager
def run_config_file(run_config: Mapping[str, Any]) -> Iterator[str]:
    """``run_config`` written to a temporary TOML file (for ``flwr run --run-config``);
    the file is removed when the block ends."""
    with tempfile.NamedTemporaryFile("wb", suffix=".toml", delete=False) as handle:
        handle.write(tomli_w.dumps(dict(run_config)).encode())
    try:
        yield handle.name
    finally:
        os.unlink(handle.name)


def app_defaults(app_dir: Path = APP_DIR) -> dict[str, Any]:
    """The app's run-config defaults (``[tool.flwr.app.config]`` of pyproject.toml)."""
    return dict(read_toml(Path(app_dir) / "pyproject.toml")["tool"]["flwr"]["app"]["config"])


def absolute_paths(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """``output-dir`` and ``data-dir`` made absolute against this process's cwd (the
    ServerApp and ClientApps would resolve them against the SuperLink's); a ``~`` that
    names no user's home is a ConfigError."""
    out = dict(run_config)
    for key in ("output-dir", "data-dir"):
        if out.get(key):
            out[key] = str(expand_user(str(out[key]), key).resolve())
    return out


def check_declared(keys: Iterable[str], declared: Mapping[str, Any],
                   app_dir: Path = APP_DIR) -> None:
    """A ConfigError naming the ``x-`` keys among ``keys`` that ``declared`` (the app's
    ``[tool.flwr.app.config]``) lacks: Flower's SuperLink refuses a run-config key the
    app does not declare, so such a run would fail only once started."""
    undeclared = sorted(key for key in keys if str(key).startswith("x-") and key not in declared)
    if undeclared:
        raise ConfigError(
            f"run-config key(s) {', '.join(undeclared)} are not declared in "
            f"[tool.flwr.app.config] of {Path(app_dir) / 'pyproject.toml'}; a SuperLink "
            f"refuses undeclared keys: add each there with a default (e.g. "
            f"{undeclared[0]} = \"\") first")


def resolve_run_config(overrides: Mapping[str, Any], app_dir: Path = APP_DIR
                       ) -> tuple[dict[str, Any], RunConfig]:
    """The app's defaults, then ``overrides``, paths absolute; and that, parsed and checked."""
    declared = app_defaults(app_dir)
    check_declared(overrides, declared, app_dir)
    defaults = absolute_paths({"output-dir": "results", **declared})
    merged = {**defaults, **absolute_paths(overrides)}
    return merged, parse_run_config(merged)


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
    """``"a=1 b='x'"`` → ``{"a": 1, "b": "x"}``: values are TOML scalars, as ``flwr run
    --run-config`` reads them, but a word that is not a ``key=value`` pair is an error."""
    if not text.strip():
        return {}
    if not _ASSIGNMENTS.fullmatch(text):
        raise ConfigError(f"overrides must be space-separated key=value pairs, got {text!r}")
    values: dict[str, Any] = {}
    for key, raw in _PAIR_GROUPS.findall(text):
        try:
            value = tomllib.loads(f"value = {raw}")["value"]
        except tomllib.TOMLDecodeError:
            value = None
        if not isinstance(value, (bool, int, float, str)):
            raise ConfigError(f"override {key}={raw}: the value must be a TOML number, "
                              "true/false or a quoted string")
        values[key] = value
    return values


def load_overrides(preset: str | Path | None = None, assignments: str = "") -> dict[str, Any]:
    """What a user asks for on a command line: the TOML ``preset``, then ``assignments``.
    A preset's values are scalars, as Flower's run-config carries them: a TOML array,
    table or date-time is a ConfigError naming the key."""
    overrides = read_toml(preset) if preset else {}
    for key, value in overrides.items():
        if not isinstance(value, (bool, int, float, str)):
            raise ConfigError(
                f"run-config file {preset}: '{key}' must be a TOML number, true/false or a "
                f"quoted string, got {value!r} (quote it: a time as stop-by = "
                '"2026-12-05T18:30:00+01:00", keys as shared-keys = "features.0,features.3")')
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


def check_clients(num_clients: int, clients: int) -> None:
    """A simulation's clients are its SuperNodes: a run-config ``num-clients`` other
    than 0 must name as many, or every client would refuse the run."""
    if num_clients and num_clients != clients:
        raise ConfigError(
            f"run-config num-clients={num_clients} but the simulation has {clients} "
            f"clients (SuperNodes): give --clients {num_clients}, or num-clients=0 (all)")
