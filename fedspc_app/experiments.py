"""Experiment grids: expand a YAML grid into runs, run them resumably, report on them.

A grid file (``conf/experiments/*.yaml``) describes many runs at once::

    name: table3                    # optional; default: the file's stem
    base:                           # run-config shared by every cell (kebab-case keys)
      preset: conf/cifar100-resnet34.toml   # optional TOML preset underneath base
      num-rounds: 100
    axes:                           # the cartesian product of these is the grid
      setting:                      # a mapping of labelled bundles of keys
        C-ViT: {dataset: cifar100, model: vit, learning-rate: 0.005}
        C-R34: {preset: conf/cifar100-resnet34.toml}
      method: [fedper, fedrep]      # a list: values of the run-config key "method"
      fedspc: [false, true]
      alpha: [0.01, 0.1, 1.0]
    exclude:                        # partial assignments to drop
      - {method: fedrep, alpha: 1.0}
    simulation: {clients: 10, client-cpus: 2, client-gpus: 0.25, timeout: 86400}
    centralized: {epochs: 200, learning-rate: 0.1}   # optional pooled-data reference

Layers are merged in this order, later ones winning: the app's defaults
(pyproject.toml), ``base.preset``, ``base``, each axis in the order written (a
bundle's ``preset``, then its keys), then ``--set``. Every cell runs in
``<output-dir>/<grid name>/<run-name>``, with a run-name built from its axis values
(``fedrep+fedspc-a0.1-C-R34``). Every cell is validated with
:func:`fedspc_app.core.config.parse_run_config` before anything runs. Relative
``data-dir`` and ``output-dir`` values are resolved against the working directory,
preset paths against the grid file's folder, then the repository root.

Command line::

    python -m fedspc_app.experiments run GRID.yaml [--only method=fedrep,fedper]
        [--only alpha=0.1] [--dry-run] [--output-dir DIR] [--set "k=v ..."]
        [--retry-failed] [--clients N] [--client-cpus X] [--client-gpus X]
    python -m fedspc_app.experiments list GRID.yaml        # the same as run --dry-run
    python -m fedspc_app.experiments report GRID_DIR_OR_YAML [--out DIR]

Cells whose ``summary.json`` says ``"complete": true`` are skipped, so a grid can be
interrupted and rerun. A failing cell is recorded in ``failures.json`` and the others
still run; failed cells are retried only with ``--retry-failed``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import tomli_w
import yaml

from fedspc_app.core.config import parse_run_config
from fedspc_app.core.errors import ConfigError, FedSPCError
from fedspc_app.core.files import atomic_write
from fedspc_app.core.results import format_duration
from fedspc_app.launch.processes import exit_on_termination
from fedspc_app.launch.runconfig import (
    APP_DIR,
    absolute_paths,
    app_defaults,
    parse_assignments,
    read_toml,
)
from fedspc_app.launch.superlink import LocalSuperLink, SimulationFailed, run_simulation

GRID_KEYS = ("name", "description", "base", "axes", "exclude", "simulation", "centralized")
SIMULATION_KEYS = ("clients", "client-cpus", "client-gpus", "timeout")
CENTRALIZED_OPTIONS = {"epochs": 200, "learning-rate": 0.1, "eval-every": 1,
                       "lr-schedule": "constant"}
MODE_AXIS = "mode"
"""Pseudo-axis for ``--only``: ``federated`` or ``centralized`` cells."""

# Axes that form the rows of the tables (or are averaged over); every other axis
# is part of a cell's "setting" (the tables' columns).
ROW_AXES = ("method", "fedspc", "alpha", "seed")

# Run-config keys that only matter to federated training: a centralized reference
# is shared by all cells that differ only in these.
FEDERATED_ONLY = frozenset({
    "method", "fedspc", "fedspc-upload", "num-rounds", "num-clients", "fraction-train",
    "aggregation", "alpha", "min-samples", "partition-max-tries", "local-epochs",
    "learning-rate", "proximal-mu", "fedrep-head-epochs", "fedbabu-finetune-epochs",
    "fedbabu-finetune-parts", "ditto-lambda", "ditto-personal-epochs",
})

# Short run-name prefixes for numeric axes.
ABBREVIATIONS = {
    "learning-rate": "lr", "local-epochs": "e", "num-rounds": "r", "batch-size": "b",
    "momentum": "m", "weight-decay": "wd", "proximal-mu": "mu", "ditto-lambda": "lam",
    "fraction-train": "f", "vit-embed-dim": "d", "alpha": "a", "seed": "s",
}
PLAIN_VALUES = ("method", "model", "dataset")

GRID_JSON = "grid.json"
FAILURES_JSON = "failures.json"
PRESET = "preset"

Echo = Callable[[str], None]


# ----------------------------------------------------------------------- data model
@dataclass(frozen=True)
class SimulationSettings:
    """How cells run in Flower's simulation engine.

    Attributes
    ----------
    clients : int
        Simulated SuperNodes (the paper's K = 10).
    client_cpus, client_gpus : float
        Resources each simulated client reserves.
    timeout : float | None
        Seconds one cell may run before it is stopped and counted as failed.
    """

    clients: int = 10
    client_cpus: float = 1.0
    client_gpus: float = 0.0
    timeout: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"clients": self.clients, "client-cpus": self.client_cpus,
                "client-gpus": self.client_gpus, "timeout": self.timeout}


@dataclass(frozen=True)
class Cell:
    """One run of a grid.

    Attributes
    ----------
    name : str
        Its run-name (the folder under the grid directory).
    kind : str
        ``"federated"`` or ``"centralized"`` (the pooled-data reference).
    assignment : dict
        Axis name → value (a bundle axis gives its label), in the grid's axis order.
    setting : str
        The cell's table column: its values of every axis that is not a row axis
        (method, fedspc, alpha, seed), or ``<dataset>-<model>`` when there is none.
    run_config : dict
        The complete, validated run-config (kebab-case keys).
    centralized : dict
        For centralized cells: ``epochs``, ``learning-rate``, ``eval-every``,
        ``lr-schedule``; empty otherwise.
    """

    name: str
    kind: str
    assignment: dict[str, Any]
    setting: str
    run_config: dict[str, Any]
    centralized: dict[str, Any] = field(default_factory=dict)

    @property
    def run_dir(self) -> Path:
        return Path(self.run_config["output-dir"]) / self.name

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "kind": self.kind, "assignment": self.assignment,
               "setting": self.setting, "run-config": self.run_config}
        if self.centralized:
            out["centralized"] = self.centralized
        return out


@dataclass(frozen=True)
class Grid:
    """An expanded grid: every cell, validated, and where they go.

    Attributes
    ----------
    name : str
        The grid's name (its folder under the output directory).
    directory : pathlib.Path
        ``<output-dir>/<name>``, absolute.
    axes : dict
        Axis name → its values (labels for bundle axes), in the order written.
    cells : tuple of Cell
        Federated cells in product order, then the centralized references.
    simulation : SimulationSettings
    source : pathlib.Path | None
        The YAML file it came from.
    """

    name: str
    directory: Path
    axes: dict[str, list[Any]]
    cells: tuple[Cell, ...]
    simulation: SimulationSettings
    source: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "source": str(self.source) if self.source else None,
                "directory": str(self.directory), "axes": self.axes,
                "simulation": self.simulation.to_dict(),
                "cells": [cell.to_dict() for cell in self.cells]}


@dataclass(frozen=True)
class _AxisValue:
    label: Any
    layer: dict[str, Any]


@dataclass(frozen=True)
class _Axis:
    name: str
    values: tuple[_AxisValue, ...]
    bundle: bool


# -------------------------------------------------------------------- expansion
def same_value(a: Any, b: Any) -> bool:
    """Equality for axis values: numbers by value (``1 == 1.0``), booleans only
    equal booleans, anything else by its text."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return str(a) == str(b)


def _sanitize(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+=-]+", "_", text).strip("_") or "_"


def value_token(axis: str, value: Any, *, bundle: bool = False) -> str:
    """The part of a run-name that one axis value contributes.

    Bundle labels and the values of ``method``, ``model`` and ``dataset`` appear as
    they are; numbers get a short prefix (``a0.1``, ``s0``, ``lr0.005``); other
    values are ``<key>-<value>``.
    """
    if bundle or axis in PLAIN_VALUES:
        return _sanitize(str(value))
    if axis == PRESET:
        return _sanitize(Path(str(value)).stem)
    if isinstance(value, bool):
        return _sanitize(f"{axis}-{str(value).lower()}")
    if isinstance(value, (int, float)):
        prefix = ABBREVIATIONS.get(axis, axis)
        return _sanitize(f"{prefix}{value:g}")
    if axis in ABBREVIATIONS:
        return _sanitize(f"{ABBREVIATIONS[axis]}{value}")
    return _sanitize(f"{axis}-{value}")


def _run_name(axes: Sequence[_Axis], assignment: Mapping[str, Any],
              config: Mapping[str, Any]) -> str:
    """``<method>[+fedspc]-a<alpha>-s<seed>-<other axes in order>``, axis values only."""
    tokens: list[str] = []
    names = {axis.name for axis in axes}
    if "method" in names or "fedspc" in names:
        method = str(assignment.get("method", config.get("method", "")))
        spc = assignment.get("fedspc", config.get("fedspc", False))
        tokens.append(_sanitize(method) + ("+fedspc" if spc is True
                                           or str(spc).lower() == "true" else ""))
    for key in ("alpha", "seed"):
        if key in names:
            tokens.append(value_token(key, assignment[key]))
    for axis in axes:
        if axis.name not in ROW_AXES:
            tokens.append(value_token(axis.name, assignment[axis.name], bundle=axis.bundle))
    return "-".join(tokens) or "run"


def _setting_label(axes: Sequence[_Axis], assignment: Mapping[str, Any],
                   config: Mapping[str, Any]) -> str:
    tokens = [value_token(axis.name, assignment[axis.name], bundle=axis.bundle)
              for axis in axes if axis.name not in ROW_AXES and axis.name in assignment]
    return " ".join(tokens) if tokens else f"{config.get('dataset')}-{config.get('model')}"


def find_preset(path: str, base_dir: Path | None) -> Path:
    """A preset path as written: absolute, or relative to the grid file or the repo root."""
    candidate = Path(path).expanduser()
    if candidate.is_absolute():
        places = [candidate]
    else:
        places = [root / candidate for root in (base_dir, APP_DIR, Path.cwd()) if root]
    for place in places:
        if place.is_file():
            return place.resolve()
    raise ConfigError(f"preset {path!r} not found (looked at: "
                      f"{', '.join(str(p) for p in places)})")


def _layer(values: Any, base_dir: Path | None, where: str) -> dict[str, Any]:
    """A mapping of run-config keys (with an optional ``preset``) as one flat layer."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where} must be a mapping of run-config keys, got {values!r}")
    layer: dict[str, Any] = {}
    if PRESET in values:
        preset = find_preset(str(values[PRESET]), base_dir)
        try:
            layer.update(read_toml(preset))
        except (OSError, ValueError) as error:
            raise ConfigError(f"{where}: cannot read preset {preset}: {error}") from None
    for key, value in values.items():
        if key == PRESET:
            continue
        if isinstance(value, (Mapping, list)) or value is None:
            raise ConfigError(f"{where}: run-config '{key}' must be a single value, "
                              f"got {value!r}")
        layer[str(key)] = value
    if "run-name" in layer:
        raise ConfigError(f"{where}: 'run-name' is set per cell by the grid")
    return layer


def _parse_axes(raw: Any, base_dir: Path | None) -> list[_Axis]:
    if raw is None:
        return []
    if not isinstance(raw, Mapping):
        raise ConfigError("'axes' must be a mapping of axis name → values")
    axes = []
    for name, values in raw.items():
        name = str(name)
        if name in ("run-name", "output-dir", MODE_AXIS):
            raise ConfigError(f"'{name}' cannot be an axis")
        if isinstance(values, Mapping):
            if not values:
                raise ConfigError(f"axis '{name}' has no values")
            items = tuple(_AxisValue(str(label), _layer(bundle, base_dir,
                                                        f"axis '{name}' value '{label}'"))
                          for label, bundle in values.items())
            axes.append(_Axis(name, items, bundle=True))
            continue
        if not isinstance(values, list) or not values:
            raise ConfigError(f"axis '{name}' must be a non-empty list of values or a "
                              f"mapping of labelled bundles, got {values!r}")
        items = []
        for value in values:
            if isinstance(value, (Mapping, list)) or value is None:
                raise ConfigError(f"axis '{name}': {value!r} is not a single value "
                                  "(write bundles as a mapping label: {keys})")
            layer = (_layer({PRESET: value}, base_dir, f"axis '{name}' value {value!r}")
                     if name == PRESET else _layer({name: value}, base_dir, f"axis '{name}'"))
            items.append(_AxisValue(value, layer))
        axes.append(_Axis(name, tuple(items), bundle=False))
    for axis in axes:
        for i, a in enumerate(axis.values):
            if any(same_value(a.label, b.label) for b in axis.values[:i]):
                raise ConfigError(f"axis '{axis.name}' lists {a.label!r} twice")
    return axes


def _check_assignment(entry: Any, axes: Sequence[_Axis], what: str) -> dict[str, Any]:
    """A partial assignment ``{axis: value}`` whose axes and values exist."""
    if not isinstance(entry, Mapping) or not entry:
        raise ConfigError(f"{what} must be a non-empty mapping axis → value, got {entry!r}")
    by_name = {axis.name: axis for axis in axes}
    for key, value in entry.items():
        if key not in by_name:
            raise ConfigError(f"{what}: '{key}' is not an axis (axes: {', '.join(by_name)})")
        if not any(same_value(value, v.label) for v in by_name[key].values):
            labels = ", ".join(repr(v.label) for v in by_name[key].values)
            raise ConfigError(f"{what}: {value!r} is not a value of axis '{key}' ({labels})")
    return dict(entry)


def _matches(assignment: Mapping[str, Any], partial: Mapping[str, Any]) -> bool:
    return all(key in assignment and same_value(assignment[key], value)
               for key, value in partial.items())


def _simulation(raw: Any) -> SimulationSettings:
    if raw is None:
        return SimulationSettings()
    if not isinstance(raw, Mapping):
        raise ConfigError("'simulation' must be a mapping")
    unknown = set(raw) - set(SIMULATION_KEYS)
    if unknown:
        raise ConfigError(f"unknown simulation setting(s) {sorted(unknown)}; "
                          f"known: {', '.join(SIMULATION_KEYS)}")
    try:
        settings = SimulationSettings(
            clients=int(raw.get("clients", 10)),
            client_cpus=float(raw.get("client-cpus", 1.0)),
            client_gpus=float(raw.get("client-gpus", 0.0)),
            timeout=None if raw.get("timeout") is None else float(raw["timeout"]),
        )
    except (TypeError, ValueError) as error:
        raise ConfigError(f"bad simulation setting: {error}") from None
    if settings.clients < 1 or settings.client_cpus <= 0 or settings.client_gpus < 0:
        raise ConfigError(f"simulation settings out of range: {settings}")
    return settings


def _validate(name: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """The cell's full run-config, or a ConfigError naming the cell."""
    try:
        return parse_run_config(config).to_dict()
    except ConfigError as error:
        raise ConfigError(f"cell {name}: {error}") from None


def _centralized_cells(raw: Any, axes: Sequence[_Axis], cells: Sequence[Cell],
                       defaults: Mapping[str, Any], base_dir: Path | None) -> list[Cell]:
    """One pooled-data reference per combination of the axes it depends on."""
    if raw is None or raw is False:
        return []
    if raw is True:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError("'centralized' must be a mapping (epochs, learning-rate, ...)")
    options = {key: raw.get(key, value) for key, value in CENTRALIZED_OPTIONS.items()}
    try:
        options["epochs"] = int(options["epochs"])
        options["eval-every"] = int(options["eval-every"])
        options["learning-rate"] = float(options["learning-rate"])
    except (TypeError, ValueError) as error:
        raise ConfigError(f"centralized: {error}") from None
    if options["epochs"] < 1 or options["eval-every"] < 1 or not options["learning-rate"] > 0:
        raise ConfigError(f"centralized: epochs, eval-every and learning-rate must be "
                          f"positive, got {options}")
    if options["lr-schedule"] not in ("constant", "cosine"):
        raise ConfigError(f"centralized: lr-schedule must be constant or cosine, "
                          f"got {options['lr-schedule']!r}")
    extra = _layer({k: v for k, v in raw.items() if k not in CENTRALIZED_OPTIONS},
                   base_dir, "centralized")
    relevant = [axis for axis in axes if axis.bundle or axis.name not in FEDERATED_ONLY]
    out: list[Cell] = []
    seen: set[str] = set()
    for cell in cells:
        assignment = {axis.name: cell.assignment[axis.name] for axis in relevant}
        tokens = [value_token(axis.name, assignment[axis.name], bundle=axis.bundle)
                  for axis in sorted(relevant, key=lambda a: a.name != "seed")]
        name = "-".join(["centralized", *tokens]) if tokens else (
            f"centralized-{cell.run_config['dataset']}-{cell.run_config['model']}")
        if name in seen:
            continue
        seen.add(name)
        # Keys only federated training reads go back to their defaults, so that the
        # reference's config.json does not suggest a method or an alpha.
        reset = {key: defaults[key] for key in FEDERATED_ONLY if key in defaults}
        config = {**cell.run_config, **reset, **extra,
                  "learning-rate": options["learning-rate"], "run-name": name}
        out.append(Cell(name=name, kind="centralized", assignment=assignment,
                        setting=_setting_label(relevant, assignment, config),
                        run_config=_validate(name, config), centralized=dict(options)))
    return out


def expand_grid(spec: Mapping[str, Any], *, name: str, base_dir: Path | None = None,
                output_dir: str | os.PathLike[str] | None = None,
                overrides: Mapping[str, Any] | None = None,
                defaults: Mapping[str, Any] | None = None,
                source: Path | None = None) -> Grid:
    """Expand a parsed grid file into validated cells.

    Parameters
    ----------
    spec : mapping
        The grid file's content (see the module docstring).
    name : str
        Grid name, used when ``spec`` has no ``name``.
    base_dir : pathlib.Path, optional
        Folder of the grid file (presets are looked up there first, then in the repo).
    output_dir : path-like, optional
        Parent of the grid's folder; default ``--set``'s, then ``base``'s
        ``output-dir``, then the app default (``results``).
    overrides : mapping, optional
        ``--set`` values, applied to every cell last. They may not set an axis's key.
    defaults : mapping, optional
        Run-config defaults; default :func:`fedspc_app.simulate.app_defaults`.
    source : pathlib.Path, optional
        Recorded in the grid.

    Returns
    -------
    Grid

    Raises
    ------
    ConfigError
        On any malformed entry, or a cell whose run-config does not validate (the
        message names the cell), before anything runs.
    """
    if not isinstance(spec, Mapping):
        raise ConfigError("a grid file must hold a mapping")
    unknown = set(spec) - set(GRID_KEYS)
    if unknown:
        raise ConfigError(f"unknown grid key(s) {sorted(unknown)}; known: {', '.join(GRID_KEYS)}")
    defaults = dict(app_defaults() if defaults is None else defaults)
    grid_name = _sanitize(str(spec.get("name") or name))
    base = _layer(spec.get("base") or {}, base_dir, "base")
    axes = _parse_axes(spec.get("axes"), base_dir)
    overrides = dict(overrides or {})
    if "run-name" in overrides:
        raise ConfigError("'run-name' is set per cell by the grid")
    scalar_axes = {axis.name for axis in axes if not axis.bundle}
    clash = sorted(scalar_axes & set(overrides))
    if clash:
        raise ConfigError(f"--set {', '.join(clash)}: an axis of this grid; "
                          "choose its values with --only")
    exclude_raw = spec.get("exclude") or []
    if not isinstance(exclude_raw, list):
        raise ConfigError("'exclude' must be a list of partial assignments")
    excludes = [_check_assignment(entry, axes, f"exclude[{i}]")
                for i, entry in enumerate(exclude_raw)]

    parent = output_dir or overrides.get("output-dir") or base.get("output-dir") \
        or defaults.get("output-dir") or "results"
    directory = Path(str(parent)).expanduser().resolve() / grid_name
    cells: list[Cell] = []
    for combination in itertools.product(*(axis.values for axis in axes)):
        assignment = {axis.name: value.label for axis, value in zip(axes, combination)}
        if any(_matches(assignment, partial) for partial in excludes):
            continue
        config = {**defaults, **base}
        for value in combination:
            config.update(value.layer)
        config.update(overrides)
        cell_name = _run_name(axes, assignment, config)
        config.update({"output-dir": str(directory), "run-name": cell_name})
        config = absolute_paths(config)
        cells.append(Cell(name=cell_name, kind="federated", assignment=assignment,
                          setting=_setting_label(axes, assignment, config),
                          run_config=_validate(cell_name, config)))
    if not cells:
        raise ConfigError(f"grid {grid_name!r} has no cells (everything excluded?)")
    cells += _centralized_cells(spec.get("centralized"), axes, cells, defaults, base_dir)
    names = [cell.name for cell in cells]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"grid {grid_name!r}: several cells are named {duplicates}; "
                          "give bundles distinct labels")
    return Grid(name=grid_name, directory=directory,
                axes={axis.name: [value.label for value in axis.values] for axis in axes},
                cells=tuple(cells), simulation=_simulation(spec.get("simulation")),
                source=source)


def load_grid(path: str | os.PathLike[str], *,
              output_dir: str | os.PathLike[str] | None = None,
              overrides: Mapping[str, Any] | None = None,
              defaults: Mapping[str, Any] | None = None) -> Grid:
    """Read and expand a grid file (see :func:`expand_grid`)."""
    path = Path(path)
    try:
        spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"no grid file at {path}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from None
    return expand_grid(spec or {}, name=path.stem, base_dir=path.resolve().parent,
                       output_dir=output_dir, overrides=overrides, defaults=defaults,
                       source=path.resolve())


# ---------------------------------------------------------------------- filtering
def parse_only(items: Iterable[str]) -> dict[str, list[Any]]:
    """``["method=fedrep,fedper", "alpha=0.1"]`` → ``{"method": ["fedrep", "fedper"], ...}``.

    Values are read as YAML scalars (``0.1`` a number, ``true`` a boolean). Repeating
    a key adds values to it.
    """
    only: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key.strip() or not values.strip():
            raise ConfigError(f"--only expects axis=value[,value...], got {item!r}")
        parsed = [yaml.safe_load(v.strip()) for v in values.split(",") if v.strip()]
        only.setdefault(key.strip(), []).extend(parsed)
    return only


def filter_cells(grid: Grid, only: Mapping[str, Sequence[Any]]) -> list[Cell]:
    """The cells whose value of every axis in ``only`` is one of the listed ones.

    ``mode`` selects ``federated`` or ``centralized`` cells. A cell without one of
    the axes (a centralized cell has no ``method``) is left out. An axis or a value
    that the grid does not have is an error, so that a typo does not select nothing.
    """
    for key, values in only.items():
        known = ["federated", "centralized"] if key == MODE_AXIS else grid.axes.get(key)
        if known is None:
            raise ConfigError(f"--only {key}: not an axis of grid {grid.name!r} "
                              f"(axes: {', '.join([*grid.axes, MODE_AXIS])})")
        for value in values:
            if not any(same_value(value, k) for k in known):
                raise ConfigError(f"--only {key}={value}: not a value of that axis "
                                  f"({', '.join(map(str, known))})")

    def keep(cell: Cell) -> bool:
        for key, values in only.items():
            have = cell.kind if key == MODE_AXIS else cell.assignment.get(key, _MISSING)
            if have is _MISSING or not any(same_value(have, v) for v in values):
                return False
        return True

    return [cell for cell in grid.cells if keep(cell)]


_MISSING = object()


# ------------------------------------------------------------------------ status
def read_json(path: Path) -> Any:
    """A JSON file's content, or None when it is missing or unreadable."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def is_done(cell: Cell) -> bool:
    """Whether the cell's ``summary.json`` says ``"complete": true``."""
    summary = read_json(cell.run_dir / "summary.json")
    return isinstance(summary, dict) and summary.get("complete") is True


# Settings that may change without invalidating a finished run.
_IRRELEVANT = {"data-dir", "output-dir", "download", "device"}


def config_changes(cell: Cell) -> list[str]:
    """Run-config keys whose value differs between the grid and the finished run."""
    recorded = read_json(cell.run_dir / "config.json")
    if not isinstance(recorded, dict) or not isinstance(recorded.get("run-config"), dict):
        return []
    old = recorded["run-config"]
    return sorted(key for key, value in cell.run_config.items()
                  if key not in _IRRELEVANT and key in old and old[key] != value)


def read_failures(directory: Path) -> dict[str, dict[str, Any]]:
    failures = read_json(directory / FAILURES_JSON)
    return failures if isinstance(failures, dict) else {}


def cell_status(cell: Cell, failures: Mapping[str, Any]) -> str:
    """``done``, ``failed`` (recorded in failures.json) or ``pending``."""
    if is_done(cell):
        return "done"
    return "failed" if cell.name in failures else "pending"


def describe(cell: Cell) -> str:
    """The key settings of a cell, on one line."""
    rc = cell.run_config
    what = f"{rc['dataset']}/{rc['model']}"
    if cell.kind == "centralized":
        opts = cell.centralized
        return (f"{what} centralized, {opts['epochs']} epochs, lr {opts['learning-rate']:g}"
                f" ({opts['lr-schedule']}), batch {rc['batch-size']}, seed {rc['seed']}")
    label = rc["method"] + ("+fedspc" if rc["fedspc"] else "")
    return (f"{what} {label} alpha={float(rc['alpha'])!r} seed={rc['seed']} | "
            f"{rc['num-rounds']} rounds, E={rc['local-epochs']}, "
            f"lr {rc['learning-rate']:g}, batch {rc['batch-size']}")


def write_grid_json(grid: Grid) -> Path:
    path = grid.directory / GRID_JSON
    atomic_write(path, json.dumps(grid.to_dict(), indent=2) + "\n")
    return path


# ----------------------------------------------------------------------- running
class SharedSuperLink:
    """One :class:`LocalSuperLink` for every federated cell of an invocation.

    Started on first use (a grid with nothing to run starts nothing) and restarted
    when it has died or after a timed-out cell, whose run would otherwise keep
    occupying the simulation.
    """

    def __init__(self, flwr_home: Path | None = None, log_file: Path | None = None) -> None:
        self._stack = contextlib.ExitStack()
        self._home = flwr_home
        self._log_file = log_file
        self._link: LocalSuperLink | None = None

    def get(self) -> LocalSuperLink:
        if self._link is not None and self._link.process is not None \
                and self._link.process.poll() is None:
            return self._link
        self.stop()
        if self._home is None:
            self._home = Path(self._stack.enter_context(
                tempfile.TemporaryDirectory(prefix="fedspc-flwr-")))
        self._link = LocalSuperLink(self._home, log_file=self._log_file).start()
        return self._link

    def stop(self) -> None:
        if self._link is not None:
            self._link.stop()
            self._link = None

    def close(self) -> None:
        self.stop()
        self._stack.close()

    def __enter__(self) -> "SharedSuperLink":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_federated_cell(cell: Cell, log_file: Path, *, link: SharedSuperLink,
                       simulation: SimulationSettings, echo: bool = False) -> dict[str, Any]:
    """Run one federated cell through :func:`fedspc_app.simulate.run_simulation`."""
    try:
        return run_simulation(cell.run_config, superlink=link.get(),
                              clients=simulation.clients, client_cpus=simulation.client_cpus,
                              client_gpus=simulation.client_gpus, log_file=log_file,
                              timeout=simulation.timeout, echo=echo)
    except TimeoutError:
        link.stop()
        raise


def run_centralized_cell(cell: Cell, log_file: Path, *, timeout: float | None = None,
                         echo: bool = False) -> dict[str, Any]:
    """Run one centralized reference with ``python -m fedspc_app.centralized``.

    A separate process, so that its output goes to the cell's log and a timeout can
    stop it.
    """
    options = cell.centralized
    with tempfile.NamedTemporaryFile("wb", suffix=".toml", delete=False) as handle:
        handle.write(tomli_w.dumps(cell.run_config).encode())
        config_path = handle.name
    command = [sys.executable, "-m", "fedspc_app.centralized", "--run-config", config_path,
               "--epochs", str(options["epochs"]),
               "--learning-rate", repr(float(options["learning-rate"])),
               "--eval-every", str(options["eval-every"]),
               "--lr-schedule", str(options["lr-schedule"])]
    started = time.time()
    try:
        with open(log_file, "ab") as sink:
            process = subprocess.Popen(command, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
            assert process.stdout is not None
            deadline = None if timeout is None else time.monotonic() + timeout
            for line in process.stdout:
                sink.write(line)
                sink.flush()
                if echo:
                    sys.stdout.write(line.decode(errors="replace"))
                    sys.stdout.flush()
                if deadline is not None and time.monotonic() > deadline:
                    process.kill()
                    process.wait()
                    raise TimeoutError(f"centralized run exceeded {timeout:.0f} s")
            code = process.wait()
    finally:
        os.unlink(config_path)
    summary_path = cell.run_dir / "summary.json"
    summary = read_json(summary_path)
    if code != 0 or not isinstance(summary, dict) or not summary.get("complete") \
            or summary_path.stat().st_mtime < started:
        raise SimulationFailed(f"centralized run {cell.name!r} did not complete "
                               f"(exit code {code}); see {log_file}")
    return summary


class CellRunner:
    """Runs one cell of any kind; federated cells share one SuperLink."""

    def __init__(self, simulation: SimulationSettings, *, flwr_home: Path | None = None,
                 superlink_log: Path | None = None, echo: bool = False) -> None:
        self.simulation = simulation
        self.echo = echo
        self.link = SharedSuperLink(flwr_home, superlink_log)

    def __call__(self, cell: Cell, log_file: Path) -> dict[str, Any]:
        if cell.kind == "centralized":
            return run_centralized_cell(cell, log_file, timeout=self.simulation.timeout,
                                        echo=self.echo)
        return run_federated_cell(cell, log_file, link=self.link,
                                  simulation=self.simulation, echo=self.echo)

    def close(self) -> None:
        self.link.close()

    def __enter__(self) -> "CellRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


CELL_ERRORS = (SimulationFailed, FedSPCError, TimeoutError)
"""What a failing cell raises; anything else (e.g. Ctrl-C) stops the grid."""


@dataclass
class GridOutcome:
    """What :func:`run_grid` did: cell names by result."""

    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    """Run-name → log file, for cells that failed now or earlier (not retried)."""

    @property
    def ok(self) -> bool:
        return not self.failed


def log_path(grid: Grid, cell: Cell) -> Path:
    return grid.directory / "logs" / f"{cell.name}.log"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def run_grid(grid: Grid, cells: Sequence[Cell], *,
             runner: Callable[[Cell, Path], Mapping[str, Any]],
             retry_failed: bool = False, echo: Echo = print,
             clock: Callable[[], float] = time.monotonic) -> GridOutcome:
    """Run the pending ``cells`` of ``grid`` one after another.

    Finished cells (a complete ``summary.json``) are skipped; cells recorded in
    ``failures.json`` are skipped unless ``retry_failed``. A cell that raises one of
    :data:`CELL_ERRORS` is recorded there and the next one runs. Progress (cells
    done/total, elapsed time, ETA from the mean duration of the cells run so far)
    goes to ``echo``.

    Parameters
    ----------
    grid : Grid
        The whole grid (its ``grid.json`` is written).
    cells : sequence of Cell
        The cells to consider (e.g. after ``--only``).
    runner : callable
        ``runner(cell, log_file)`` runs one cell and returns its summary.
    retry_failed : bool
        Also rerun cells that failed before.
    echo : callable
        Where progress lines go.
    clock : callable
        Monotonic seconds (for tests).

    Returns
    -------
    GridOutcome
    """
    write_grid_json(grid)
    failures = read_failures(grid.directory)
    outcome = GridOutcome()
    todo: list[Cell] = []
    for cell in cells:
        status = cell_status(cell, failures)
        if status == "done":
            outcome.skipped.append(cell.name)
            changed = config_changes(cell)
            if changed:
                echo(f"note: {cell.name} finished with different {', '.join(changed)}; "
                     "delete its folder to rerun it")
        elif status == "failed" and not retry_failed:
            outcome.failed[cell.name] = str(log_path(grid, cell))
        else:
            todo.append(cell)
    total = len(cells)
    done = len(outcome.skipped)
    echo(f"Grid {grid.name}: {total} cells in {grid.directory}; {done} done, "
         f"{len(todo)} to run" + (f", {len(outcome.failed)} failed before (not retried; "
                                  "--retry-failed reruns them)" if outcome.failed else ""))
    started = clock()
    durations: list[float] = []
    for index, cell in enumerate(todo, start=1):
        log_file = log_path(grid, cell)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(log_file, "a", encoding="utf-8") as handle:
            handle.write(f"\n=== {cell.name} | {_now()} | {describe(cell)}\n")
        echo(f"[{done + 1}/{total}] {cell.name}: {describe(cell)}")
        cell_started = clock()
        try:
            summary = runner(cell, log_file)
        except CELL_ERRORS as error:
            seconds = clock() - cell_started
            failures[cell.name] = {"error": str(error), "log": str(log_file), "at": _now()}
            atomic_write(grid.directory / FAILURES_JSON, json.dumps(failures, indent=2))
            outcome.failed[cell.name] = str(log_file)
            result = f"FAILED after {format_duration(seconds)}: {error}"
        else:
            seconds = clock() - cell_started
            durations.append(seconds)
            if failures.pop(cell.name, None) is not None:
                atomic_write(grid.directory / FAILURES_JSON, json.dumps(failures, indent=2))
            outcome.ran.append(cell.name)
            final = summary.get("final-accuracy")
            result = f"done in {format_duration(seconds)}" + (
                f", final accuracy {100 * final:.2f}%" if isinstance(final, (int, float))
                else "")
        done += 1
        elapsed = clock() - started
        # Failed cells often stop early, so successful ones predict the rest better.
        mean = (sum(durations) / len(durations)) if durations else elapsed / index
        eta = format_duration(mean * (len(todo) - index))
        echo(f"[{done}/{total}] {cell.name} {result} | elapsed {format_duration(elapsed)}"
             f" | ETA {eta}")
    if outcome.failed:
        echo(f"{len(outcome.failed)} cell(s) failed:")
        for name, log in outcome.failed.items():
            echo(f"  {name}: {failures.get(name, {}).get('error', '')} (log: {log})")
    else:
        echo(f"Grid {grid.name}: all {total} selected cells done.")
    return outcome


def print_plan(grid: Grid, cells: Sequence[Cell], echo: Echo = print) -> None:
    """Each cell with its status and key settings (``--dry-run``)."""
    failures = read_failures(grid.directory)
    statuses = [cell_status(cell, failures) for cell in cells]
    counts = {s: statuses.count(s) for s in ("done", "failed", "pending")}
    sim = grid.simulation
    echo(f"Grid {grid.name}: {len(cells)} of {len(grid.cells)} cells selected in "
         f"{grid.directory}; {counts['done']} done, {counts['failed']} failed, "
         f"{counts['pending']} pending")
    echo(f"Simulation: {sim.clients} clients, {sim.client_cpus:g} CPU and "
         f"{sim.client_gpus:g} GPU each" + (f", timeout {format_duration(sim.timeout)}"
                                            if sim.timeout else ""))
    width = max(len(cell.name) for cell in cells) if cells else 0
    for cell, status in zip(cells, statuses):
        echo(f"  {status:<7} {cell.name:<{width}}  {describe(cell)}")


# --------------------------------------------------------------------------- CLI
def _grid_from_args(args: argparse.Namespace) -> Grid:
    overrides = parse_assignments(args.set) if getattr(args, "set", "") else {}
    return load_grid(args.grid, output_dir=args.output_dir, overrides=overrides)


def _simulation_from_args(grid: Grid, args: argparse.Namespace) -> SimulationSettings:
    sim = grid.simulation
    return SimulationSettings(
        clients=args.clients if args.clients is not None else sim.clients,
        client_cpus=args.client_cpus if args.client_cpus is not None else sim.client_cpus,
        client_gpus=args.client_gpus if args.client_gpus is not None else sim.client_gpus,
        timeout=args.timeout if args.timeout is not None else sim.timeout,
    )


def _report(target: str, out: str | None, output_dir: str | None) -> Path:
    from fedspc_app import reports

    path = Path(target)
    if path.is_file():
        grid = load_grid(path, output_dir=output_dir)
        directory = grid.directory
        cells = [cell.to_dict() for cell in grid.cells]
        title = grid.name
    else:
        directory = path.resolve()
        cells = None
        title = directory.name
    if not directory.is_dir():
        raise ConfigError(f"no results at {directory}")
    records = reports.load_records(directory, cells)
    out_dir = Path(out) if out else directory / "report"
    written = reports.write_report(records, out_dir, title=title)
    print(f"Report of {len(records)} cells: {out_dir} ({len(written)} files)")
    return out_dir


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fedspc_app.experiments",
        description="Run experiment grids (conf/experiments/*.yaml) and report on them.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "list"):
        sub = commands.add_parser(name, help="run the grid's pending cells" if name == "run"
                                  else "print the plan (the same as run --dry-run)")
        sub.add_argument("grid", help="grid file (YAML)")
        sub.add_argument("--only", action="append", default=[], metavar="AXIS=V1,V2",
                         help="keep cells with these axis values (repeatable; "
                              "'mode=centralized' selects the centralized references)")
        sub.add_argument("--output-dir", help="parent of the grid's folder")
        sub.add_argument("--set", default="", help='run-config overrides for every cell, '
                                                   'e.g. "data-dir=\'/data\'"')
        sub.add_argument("--clients", type=int)
        sub.add_argument("--client-cpus", type=float)
        sub.add_argument("--client-gpus", type=float)
        sub.add_argument("--timeout", type=float, help="seconds one cell may take")
        if name == "run":
            sub.add_argument("--dry-run", action="store_true", help="print the plan only")
            sub.add_argument("--retry-failed", action="store_true",
                             help="also rerun cells that failed before")
            sub.add_argument("--no-report", action="store_true",
                             help="do not write the report after running")
            sub.add_argument("--echo", action="store_true",
                             help="stream every cell's output, not only progress")
            sub.add_argument("--flwr-home", help="keep the SuperLink's FLWR_HOME here")
    report = commands.add_parser("report", help="tables and figures from a grid's results")
    report.add_argument("grid", help="grid folder (<output-dir>/<name>) or grid file")
    report.add_argument("--out", help="report folder (default: <grid folder>/report)")
    report.add_argument("--output-dir", help="with a grid file: parent of the grid's folder")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "report":
            _report(args.grid, args.out, args.output_dir)
            return 0
        grid = _grid_from_args(args)
        grid = dataclasses.replace(grid, simulation=_simulation_from_args(grid, args))
        cells = filter_cells(grid, parse_only(args.only))
        if args.command == "list" or args.dry_run:
            print_plan(grid, cells)
            return 0
        runner = CellRunner(grid.simulation, echo=args.echo,
                            flwr_home=Path(args.flwr_home) if args.flwr_home else None,
                            superlink_log=grid.directory / "logs" / "superlink.log")
        with exit_on_termination(), runner:
            outcome = run_grid(grid, cells, runner=runner, retry_failed=args.retry_failed)
        if not args.no_report:
            _report(str(grid.directory), None, None)
    except FedSPCError as error:
        print(f"fedspc: {error}", file=sys.stderr)
        return 2
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
