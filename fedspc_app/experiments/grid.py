"""Grid files: parse, expand into validated cells, exclude, select with ``--only``.

A grid file (``conf/experiments/*.yaml``)::

    name: table3                    # optional; default: the file's stem
    base: {preset: conf/cifar100-resnet34.toml, num-rounds: 100}
    axes:                           # the cartesian product of these is the grid
      setting:                      # labelled bundles of run-config keys
        C-ViT: {dataset: cifar100, model: vit, learning-rate: 0.005}
        C-R34: {preset: conf/cifar100-resnet34.toml}
      method: [fedper, fedrep]      # a list: values of the run-config key
      fedspc: [false, true]
      alpha: [0.01, 0.1, 1.0]
    exclude: [{method: fedrep, alpha: 1.0}]         # partial assignments to drop
    simulation: {clients: 10, client-cpus: 2, client-gpus: 0.25, timeout: 86400}
    centralized: {epochs: 200, learning-rate: 0.1}  # optional pooled-data reference

Layers, later ones winning: the app's defaults, ``base.preset``, ``base``, each
axis in the order written (a bundle's ``preset``, then its keys), then ``--set``.
Presets are looked up beside the grid file, then in the repository; relative
``data-dir`` and ``output-dir`` are resolved against the working directory.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedspc_app.core.config import parse_run_config
from fedspc_app.core.errors import ConfigError
from fedspc_app.experiments.layout import slug
from fedspc_app.launch.runconfig import (
    APP_DIR,
    absolute_paths,
    app_defaults,
    check_declared,
    check_resources,
    read_toml,
)
from fedspc_app.runs.results import portable_run_config, relative_path

GRID_KEYS = ("name", "description", "base", "axes", "exclude", "simulation", "centralized")
SIMULATION_KEYS = ("clients", "client-cpus", "client-gpus", "timeout")
CENTRALIZED_OPTIONS = {"epochs": 200, "learning-rate": 0.1, "eval-every": 1,
                       "lr-schedule": "constant"}
MODE_AXIS = "mode"  # pseudo-axis of --only: federated or centralized cells
PRESET = "preset"

# Axes that form the tables' rows (or are averaged over); the others make a cell's
# "setting", the tables' columns.
ROW_AXES = ("method", "fedspc", "alpha", "seed")

# Keys only federated training reads: one centralized reference serves every cell
# that differs only in these.
FEDERATED_ONLY = frozenset({
    "method", "fedspc", "fedspc-upload", "fedspc-reference", "num-rounds", "num-clients",
    "fraction-train", "aggregation", "alpha", "min-samples", "partition-max-tries", "local-epochs",
    "learning-rate", "proximal-mu", "fedrep-head-epochs", "fedbabu-finetune-epochs",
    "fedbabu-finetune-parts", "ditto-lambda", "ditto-personal-epochs", "evaluate-every",
    "evaluate-fraction", "min-train-replies", "max-failed-rounds", "round-timeout",
    "evaluate-before-aggregation", "evaluate-global-model", "keep-client-state",
    "evaluate-server", "partition", "classes-per-client", "client-state-dir", "stop-by",
})

# Run-name prefixes of numeric axes.
ABBREVIATIONS = {
    "learning-rate": "lr", "local-epochs": "e", "num-rounds": "r", "batch-size": "b",
    "momentum": "m", "weight-decay": "wd", "proximal-mu": "mu", "ditto-lambda": "lam",
    "fraction-train": "f", "vit-embed-dim": "d", "model-width": "w", "alpha": "a",
    "seed": "s", "classes-per-client": "c",
}
PLAIN_VALUES = ("method", "model", "dataset")


# ----------------------------------------------------------------------- data model
@dataclass(frozen=True)
class SimulationSettings:
    """Simulated clients, the resources each reserves, and seconds a cell may take."""

    clients: int = 10
    client_cpus: float = 1.0
    client_gpus: float = 0.0
    timeout: float | None = None

    def __post_init__(self) -> None:
        check_resources(self.clients, self.client_cpus, self.client_gpus)
        if self.timeout is not None and not self.timeout > 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {self.timeout:g}")

    def to_dict(self) -> dict[str, Any]:
        return {"clients": self.clients, "client-cpus": self.client_cpus,
                "client-gpus": self.client_gpus, "timeout": self.timeout}


@dataclass(frozen=True)
class Cell:
    """One run of a grid.

    ``kind`` is ``federated`` or ``centralized``; ``assignment`` maps each axis to
    its value (a bundle's label); ``setting`` is the table column (the values of
    the axes that are not :data:`ROW_AXES`, else ``<dataset>-<model>``);
    ``centralized`` holds a reference's epochs, learning-rate, eval-every and
    lr-schedule.
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
    """An expanded grid: federated cells in product order, then the references."""

    name: str
    directory: Path  # <output-dir>/<name>, absolute (grid.json records ".")
    axes: dict[str, list[Any]]  # axis → values (bundle labels), as written
    cells: tuple[Cell, ...]
    simulation: SimulationSettings
    source: Path | None = None
    excludes: tuple[dict[str, Any], ...] = ()  # the grid file's exclude entries

    def to_dict(self) -> dict[str, Any]:
        """The grid as ``grid.json`` records it, with no absolute path of this machine:
        every path is relative to the grid folder (the folder holding ``grid.json``),
        so a copy of it elsewhere (a clone of ``docs/results/``) still reads right.
        ``directory`` is ``.``; ``source`` the grid file from there (e.g.
        ``../../conf/experiments/<name>.yaml``, or its name alone when the two share
        no folder); each cell's run-config is :func:`portable_run_config` (its
        ``output-dir`` ``.``). Nothing reads these paths back: the runner works from
        the loaded :class:`Grid`, reports find a cell's folder by its name.
        """
        return {"name": self.name,
                "source": relative_path(self.source, self.directory) if self.source else None,
                "directory": relative_path(self.directory, self.directory), "axes": self.axes,
                "simulation": self.simulation.to_dict(),
                "cells": [{**cell.to_dict(),
                           "run-config": portable_run_config(cell.run_config, self.directory)}
                          for cell in self.cells]}


@dataclass(frozen=True)
class _AxisValue:
    label: Any
    layer: dict[str, Any]


@dataclass(frozen=True)
class _Axis:
    name: str
    values: tuple[_AxisValue, ...]
    bundle: bool


# -------------------------------------------------------------------------- names
def same_value(a: Any, b: Any) -> bool:
    """Numbers equal by value (``1 == 1.0``), also where YAML read one as text (it
    reads ``1e-2`` as a string), booleans only booleans, the rest by text."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    x, y = _number(a), _number(b)
    if x is not None and y is not None:
        return x == y
    return str(a) == str(b)


def _number(value: Any) -> float | None:
    """``value`` as a float when it is a number or text that parses as one."""
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(value) if isinstance(value, str) else None
    except ValueError:
        return None


def value_token(axis: str, value: Any, *, bundle: bool = False) -> str:
    """A run-name part: labels and method/model/dataset as they are, numbers with
    a short prefix (``a0.1``, ``lr0.005``), other values as ``<key>-<value>``."""
    if bundle or axis in PLAIN_VALUES:
        return slug(str(value))
    if axis == PRESET:
        return slug(Path(str(value)).stem)
    if isinstance(value, bool):
        return slug(f"{axis}-{str(value).lower()}")
    if isinstance(value, (int, float)):
        return slug(f"{ABBREVIATIONS.get(axis, axis)}{value:g}")
    if axis in ABBREVIATIONS:
        return slug(f"{ABBREVIATIONS[axis]}{value}")
    return slug(f"{axis}-{value}")


def _run_name(axes: Sequence[_Axis], assignment: Mapping[str, Any],
              config: Mapping[str, Any]) -> str:
    """``<method>[+fedspc]-a<alpha>-s<seed>-<other axes in order>``, axis values only."""
    tokens: list[str] = []
    names = {axis.name for axis in axes}
    if "method" in names or "fedspc" in names:
        method = str(assignment.get("method", config.get("method", "")))
        spc = assignment.get("fedspc", config.get("fedspc", False))
        tokens.append(slug(method) + ("+fedspc" if spc is True
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


# ----------------------------------------------------------------------- parsing
def find_preset(path: str, base_dir: Path | None) -> Path:
    """A preset path: absolute, or relative to the grid file, the repo or the cwd."""
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
    """Run-config keys (with an optional ``preset`` underneath) as one flat layer."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where} must be a mapping of run-config keys, got {values!r}")
    layer: dict[str, Any] = {}
    if PRESET in values:
        preset = find_preset(str(values[PRESET]), base_dir)
        try:
            layer.update(read_toml(preset))
        except ConfigError as error:
            raise ConfigError(f"{where}: {error}") from None
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


def _parse_axis(name: str, values: Any, base_dir: Path | None) -> _Axis:
    if name in ("run-name", "output-dir", MODE_AXIS):
        raise ConfigError(f"'{name}' cannot be an axis")
    if isinstance(values, Mapping):
        if not values:
            raise ConfigError(f"axis '{name}' has no values")
        return _Axis(name, tuple(
            _AxisValue(str(label), _layer(bundle, base_dir, f"axis '{name}' value '{label}'"))
            for label, bundle in values.items()), bundle=True)
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
    return _Axis(name, tuple(items), bundle=False)


def _parse_axes(raw: Any, base_dir: Path | None) -> list[_Axis]:
    if raw is None:
        return []
    if not isinstance(raw, Mapping):
        raise ConfigError("'axes' must be a mapping of axis name → values")
    axes = [_parse_axis(str(name), values, base_dir) for name, values in raw.items()]
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
        clients = int(raw.get("clients", 10))
        cpus, gpus = float(raw.get("client-cpus", 1.0)), float(raw.get("client-gpus", 0.0))
        timeout = None if raw.get("timeout") is None else float(raw["timeout"])
    except (TypeError, ValueError) as error:
        raise ConfigError(f"bad simulation setting: {error}") from None
    return SimulationSettings(clients, cpus, gpus, timeout)


def _validate(name: str, config: Mapping[str, Any],
              declared: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The cell's full run-config, or a ConfigError naming the cell; with ``declared``
    (the app's defaults: a federated cell, which a SuperLink runs) also its ``x-`` keys
    checked against them."""
    try:
        if declared is not None:
            check_declared(config, declared)
        return parse_run_config(config).to_dict()
    except ConfigError as error:
        raise ConfigError(f"cell {name}: {error}") from None


def _centralized_options(raw: Mapping[str, Any]) -> dict[str, Any]:
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
    return options


def _centralized_cells(raw: Any, axes: Sequence[_Axis], cells: Sequence[Cell],
                       defaults: Mapping[str, Any], base_dir: Path | None) -> list[Cell]:
    """One pooled-data reference per combination of the axes it depends on."""
    if raw is None or raw is False:
        return []
    if raw is True:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError("'centralized' must be a mapping (epochs, learning-rate, ...)")
    options = _centralized_options(raw)
    extra = _layer({k: v for k, v in raw.items() if k not in CENTRALIZED_OPTIONS},
                   base_dir, "centralized")
    relevant = [axis for axis in axes if axis.bundle or axis.name not in FEDERATED_ONLY]
    # Keys only federated training reads go back to their defaults, so that the
    # reference's config.json does not suggest a method or an alpha.
    reset = {key: defaults[key] for key in FEDERATED_ONLY if key in defaults}
    out: list[Cell] = []
    seen: set[str] = set()
    for cell in cells:
        assignment = {axis.name: cell.assignment[axis.name] for axis in relevant}
        tokens = [value_token(axis.name, assignment[axis.name], bundle=axis.bundle)
                  for axis in sorted(relevant, key=lambda a: a.name != "seed")]
        name = "-".join(["centralized", *tokens]) if tokens else (
            slug(f"centralized-{cell.run_config['dataset']}-{cell.run_config['model']}"))
        if name in seen:
            continue
        seen.add(name)
        config = {**cell.run_config, **reset, **extra,
                  "learning-rate": options["learning-rate"], "run-name": name}
        out.append(Cell(name=name, kind="centralized", assignment=assignment,
                        setting=_setting_label(relevant, assignment, config),
                        run_config=_validate(name, config), centralized=dict(options)))
    return out


# ---------------------------------------------------------------------- expansion
def expand_grid(spec: Mapping[str, Any], *, name: str, base_dir: Path | None = None,
                output_dir: str | os.PathLike[str] | None = None,
                overrides: Mapping[str, Any] | None = None,
                defaults: Mapping[str, Any] | None = None,
                source: Path | None = None) -> Grid:
    """Expand a parsed grid file into validated cells (a ConfigError naming the cell
    otherwise, before anything runs).

    ``name`` is used when ``spec`` has none; ``base_dir`` is where presets are looked
    up first; ``output_dir`` defaults to ``--set``'s, ``base``'s, then the app's
    ``output-dir``; ``overrides`` (``--set``) apply last and may not set an axis;
    ``defaults`` default to :func:`~fedspc_app.launch.runconfig.app_defaults`.
    """
    if not isinstance(spec, Mapping):
        raise ConfigError("a grid file must hold a mapping")
    unknown = set(spec) - set(GRID_KEYS)
    if unknown:
        raise ConfigError(f"unknown grid key(s) {sorted(unknown)}; known: {', '.join(GRID_KEYS)}")
    defaults = dict(app_defaults() if defaults is None else defaults)
    grid_name = slug(str(spec.get("name") or name))
    base = _layer(spec.get("base") or {}, base_dir, "base")
    axes = _parse_axes(spec.get("axes"), base_dir)
    overrides = dict(overrides or {})
    if "run-name" in overrides:
        raise ConfigError("'run-name' is set per cell by the grid")
    clash = sorted({axis.name for axis in axes if not axis.bundle} & set(overrides))
    if clash:
        raise ConfigError(f"--set {', '.join(clash)}: an axis of this grid; "
                          "choose its values with --only")
    exclude_raw = spec.get("exclude") or []
    if not isinstance(exclude_raw, list):
        raise ConfigError("'exclude' must be a list of partial assignments")
    excludes = [_check_assignment(entry, axes, f"exclude[{i}]")
                for i, entry in enumerate(exclude_raw)]
    simulation = _simulation(spec.get("simulation"))

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
                          run_config=_validate(cell_name, config, defaults)))
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
                cells=tuple(cells), simulation=simulation, source=source,
                excludes=tuple(excludes))


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
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read grid file {path}: {error}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(error)}") from None
    return expand_grid(spec or {}, name=path.stem, base_dir=path.resolve().parent,
                       output_dir=output_dir, overrides=overrides, defaults=defaults,
                       source=path.resolve())


def _yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML error on one line: what, and where."""
    if not isinstance(error, yaml.MarkedYAMLError) or error.problem is None:
        return " ".join(str(error).split())
    mark = error.problem_mark
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"{error.problem}{where}"


# ---------------------------------------------------------------------- selection
def parse_only(items: Iterable[str]) -> dict[str, list[Any]]:
    """``["method=fedrep,fedper", "alpha=0.1"]`` → ``{"method": ["fedrep", "fedper"],
    "alpha": [0.1]}``: values are YAML scalars; a repeated key adds values."""
    only: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key.strip() or not values.strip():
            raise ConfigError(f"--only expects axis=value[,value...], got {item!r}")
        parsed = [_scalar(key.strip(), v.strip()) for v in values.split(",") if v.strip()]
        only.setdefault(key.strip(), []).extend(parsed)
    return only


def _scalar(key: str, text: str) -> Any:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = None
    if value is None or isinstance(value, (Mapping, list)):
        raise ConfigError(f"--only {key}={text}: not a single value")
    return value


_MISSING = object()


def filter_cells(grid: Grid, only: Mapping[str, Sequence[Any]]) -> list[Cell]:
    """The cells whose value of every axis in ``only`` is a listed one.

    ``mode`` selects ``federated`` or ``centralized`` cells; a cell without the
    axis (a reference has no ``method``) is left out; an axis or value the grid
    does not have is an error, so that a typo does not select nothing, and so is a
    selection of no cell (saying why), which would otherwise run nothing and succeed.
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

    cells = [cell for cell in grid.cells if keep(cell)]
    if not cells:
        text = " ".join(f"{key}={','.join(map(str, values))}" for key, values in only.items())
        raise ConfigError(f"--only {text}: selects no cell of grid {grid.name!r}"
                          + _why_none(grid, only))
    return cells


def _why_none(grid: Grid, only: Mapping[str, Sequence[Any]]) -> str:
    """Why ``only`` (each value a grid's own) selects no cell: no references, an
    axis the references lack, or the grid's ``exclude``."""
    modes = only.get(MODE_AXIS)
    if modes is not None and not any(same_value(mode, "federated") for mode in modes):
        references = [cell for cell in grid.cells if cell.kind == "centralized"]
        if not references:
            return ": the grid has no centralized references (no 'centralized' block)"
        lacking = [key for key in only if key != MODE_AXIS
                   and any(key not in cell.assignment for cell in references)]
        if lacking:
            return f": the centralized references have no axis {', '.join(lacking)}"
    excluding = [entry for entry in grid.excludes
                 if all(any(same_value(value, v) for v in only[key])
                        for key, value in entry.items() if key in only)]
    if excluding:
        return ": the grid's exclude drops them (" + "; ".join(
            ", ".join(f"{key}: {value}" for key, value in entry.items())
            for entry in excluding) + ")"
    return ""
