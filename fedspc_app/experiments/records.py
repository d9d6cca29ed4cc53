"""Result records: what the report knows about each cell of a grid, and statistics
over seeds.

:func:`load_records` reads one :class:`ResultRecord` per cell from the cells'
``summary.json``, ``metrics.json`` and ``config.json``; the tables
(:mod:`fedspc_app.experiments.reports`) and figures
(:mod:`fedspc_app.experiments.plots`) are functions of those records.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedspc_app.core.errors import DataError
from fedspc_app.data.partition_files import load_partition_counts
from fedspc_app.experiments.layout import GRID_JSON, read_failures, read_json, result_changes
from fedspc_app.runs.provenance import code_id
from fedspc_app.runs.results import DRIFT_COLUMNS

MISSING = "—"
# Per-round metrics a record keeps besides accuracy (the drift figure's and table's).
BEFORE_AGGREGATION = "accuracy-before-aggregation"
GLOBAL_ACCURACY = "global-accuracy"  # a personal-model method's global model (evaluate-global-model)
HELD_OUT = "held-out-accuracy"  # the clients that never trained (held-out-clients)
SERIES = (*DRIFT_COLUMNS, "global-reference-norm", "train-loss", BEFORE_AGGREGATION,
          GLOBAL_ACCURACY)
METHOD_NAMES = {
    "local": "Local", "fedavg": "FedAvg", "fedprox": "FedProx", "scaffold": "SCAFFOLD", "ditto": "Ditto",
    "fedbabu": "FedBABU", "fedrep": "FedRep", "lgfedavg": "LG-FedAvg", "fedper": "FedPer",
}
"""Display names, in the paper's row order (Table 1), after the local-only reference."""

FEDERATED = "federated"
CENTRALIZED = "centralized"
LOCAL = "local"  # the method whose clients train alone: a reference row
STALE = "stale"  # a finished run made under other settings than its cell's now
# Run-config keys a record's row keys come from: the run's own (config.json) where
# it recorded them, so that a stale run is not shown as another seed or method.
ROW_KEYS = ("dataset", "method", "fedspc", "alpha", "seed", "partition", "classes-per-client")


# ------------------------------------------------------------------------ records
@dataclass(frozen=True)
class ResultRecord:
    """What the report needs to know about one cell.

    ``status`` is ``complete``, ``partial`` (started, not finished), ``failed``,
    ``missing`` or ``stale`` (finished, but under other settings than its grid cell
    asks now: ``changes`` names them; no table counts it); ``rounds`` counts epochs
    for centralized runs; accuracies are
    fractions in [0, 1] (final: the last evaluated round); ``curve`` holds
    ``(round or epoch, accuracy)`` pairs; ``run_dir`` is the results folder;
    ``client_accuracy`` maps a partition id to its accuracy in the last evaluated
    round and ``client_train_sizes`` to its training images (from the run's
    ``partition.json``; empty without one).
    """

    name: str
    kind: str = FEDERATED
    method: str = ""
    fedspc: bool = False
    alpha: float | str | None = None  # the split: see split_of
    seed: int = 0
    setting: str = ""
    dataset: str = ""
    status: str = "missing"
    rounds: int | None = None
    final_accuracy: float | None = None
    best_accuracy: float | None = None
    best_round: int | None = None
    wall_seconds: float | None = None
    curve: tuple[tuple[int, float], ...] = ()
    run_dir: Path | None = None
    series: Mapping[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    client_accuracy: Mapping[str, float] = field(default_factory=dict)
    client_train_sizes: Mapping[str, int] = field(default_factory=dict)
    # The held-out clients' mean accuracy in the last evaluated round (held-out-clients).
    held_out_accuracy: float | None = None
    # (first round, code identity) of each segment of the run (config.json); the
    # identity is None where the run did not record it.
    code: tuple[tuple[int, str | None], ...] = ()
    changes: tuple[str, ...] = ()  # a stale run's settings that differ from its cell's

    @property
    def code_ids(self) -> set[str | None]:
        """The code identities the run was made by ({None}: unrecorded)."""
        return {code for _, code in self.code} or {None}

    @property
    def code_changed_at(self) -> list[int]:
        """The rounds from which the run went on under other code than before."""
        return [first for (_, before), (first, after) in zip(self.code, self.code[1:],
                                                             strict=False)
                if before != after]

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    @property
    def label(self) -> str:
        """Display label, e.g. ``FedRep+FedSPC``."""
        return display_method(self.method) + ("+FedSPC" if self.fedspc else "")


def display_method(method: str) -> str:
    return METHOD_NAMES.get(method, method)


def read_record(run_dir: Path, cell: Mapping[str, Any] | None = None, *,
                failed: bool = False, clients: int | None = None) -> ResultRecord:
    """The record of one results folder ``run_dir`` (which may not exist yet).

    ``cell`` is the cell's ``grid.json`` entry; without it everything comes from
    the folder's ``config.json`` and the setting is ``<dataset>-<model>``. A finished
    run whose settings (or number of rounds) differ from the cell's is ``stale``;
    ``clients``, the grid's simulated clients, is a federated cell's K where its
    num-clients is 0. ``failed``: the cell is recorded as failed (shown when it did
    not finish). The summary is ``summary.json``'s, else (missing or unreadable) the
    copy a finished run's ``metrics.json`` holds.
    """
    config = read_json(run_dir / "config.json")
    config = config if isinstance(config, dict) else {}
    recorded = config.get("run-config")
    recorded = recorded if isinstance(recorded, dict) else {}
    if cell is not None:
        rc = dict(cell.get("run-config", {}))
        kind = cell.get("kind", FEDERATED)
        setting = cell.get("setting") or f"{rc.get('dataset')}-{rc.get('model')}"
    else:
        rc = dict(recorded)
        kind = CENTRALIZED if config.get("mode") == CENTRALIZED else FEDERATED
        setting = f"{rc.get('dataset')}-{rc.get('model')}"
    if rc.get("partition") == "classes" and setting == f"{rc.get('dataset')}-{rc.get('model')}":
        # another split: a setting of its own (a grid's own label already says which)
        setting = f"{setting} {rc.get('classes-per-client')} classes/client"
    metrics = read_json(run_dir / "metrics.json")
    metrics = metrics if isinstance(metrics, dict) else {}
    summary = read_json(run_dir / "summary.json")
    if not isinstance(summary, dict):  # missing or damaged: metrics.json holds a copy
        summary = metrics.get("summary")
    summary = summary if isinstance(summary, dict) else {}
    step = "epoch" if kind == CENTRALIZED else "round"
    rows = metrics.get("epochs" if kind == CENTRALIZED else "rounds") or []
    curve = tuple((int(r[step]), float(r["accuracy"])) for r in rows
                  if isinstance(r, dict) and isinstance(r.get("accuracy"), (int, float)))
    series = {key: points for key in SERIES
              if (points := tuple((int(r[step]), float(r[key])) for r in rows
                                  if isinstance(r, dict)
                                  and isinstance(r.get(key), (int, float))))}

    by_client = next((r["client-accuracy"] for r in reversed(rows) if isinstance(r, dict)
                      and isinstance(r.get("client-accuracy"), dict)), {})
    held_out = next((float(r[HELD_OUT]) for r in reversed(rows) if isinstance(r, dict)
                     and isinstance(r.get("accuracy"), (int, float))
                     and isinstance(r.get(HELD_OUT), (int, float))), None)

    changes: list[str] = []
    if cell is not None:
        changes = (_changes(rc, config, summary, clients) if kind == FEDERATED
                   else result_changes(rc, config, centralized=cell.get("centralized")))
    finished = summary.get("complete") is True
    if finished:
        status = STALE if changes else "complete"
    elif failed:
        status = "failed"
    elif config or rows:
        status = "partial"
    else:
        status = "missing"
    if finished:
        final = summary.get("final-accuracy")
        best = summary.get("best-accuracy")
        best_round = summary.get("best-epoch" if kind == CENTRALIZED else "best-round")
        rounds = summary.get("epochs" if kind == CENTRALIZED else "rounds")
        wall = summary.get("wall-seconds")
    else:
        final = curve[-1][1] if curve else None
        top = max(curve, key=lambda p: p[1]) if curve else None
        best, best_round = (top[1], top[0]) if top else (None, None)
        rounds = len(rows) if rows else None
        wall = rows[-1].get("elapsed-seconds") if rows else None
    rc = {**rc, **{key: recorded[key] for key in ROW_KEYS if key in recorded}}
    return ResultRecord(
        name=str(cell["name"]) if cell is not None else run_dir.name,
        kind=kind,
        method=CENTRALIZED if kind == CENTRALIZED else str(rc.get("method", "")),
        fedspc=kind != CENTRALIZED and bool(rc.get("fedspc", False)),
        alpha=None if kind == CENTRALIZED else split_of(rc),
        seed=int(rc.get("seed", 0)),
        setting=str(setting),
        dataset=str(rc.get("dataset", "")),
        status=status,
        rounds=rounds,
        final_accuracy=final,
        best_accuracy=best,
        best_round=best_round,
        wall_seconds=wall,
        curve=curve,
        run_dir=run_dir,
        series=series,
        client_accuracy={str(k): float(v) for k, v in by_client.items()
                         if isinstance(v, (int, float))},
        client_train_sizes=_train_sizes(run_dir) if kind == FEDERATED else {},
        code=_code_segments(config),
        held_out_accuracy=held_out,
        changes=tuple(changes) if status == STALE else (),
    )


def _changes(run_config: Mapping[str, Any], config: Mapping[str, Any],
             summary: Mapping[str, Any], clients: int | None) -> list[str]:
    """The settings a federated run (``config``, ``summary``) differs in from its
    cell's ``run_config``: its run-config and K, and its rounds if they are not the
    cell's num-rounds (a run the grid has since lengthened, or one made with --set)."""
    changes = result_changes(run_config, config, clients=clients)
    rounds, wanted = summary.get("rounds"), run_config.get("num-rounds")
    if isinstance(rounds, int) and isinstance(wanted, int) and rounds != wanted:
        changes = sorted({*changes, "num-rounds"})
    return changes


def _code_segments(config: Mapping[str, Any]) -> tuple[tuple[int, str | None], ...]:
    """(first round, code identity) per segment of a run's ``config.json``."""
    if not config:
        return ()
    segments = config.get("segments")
    if not isinstance(segments, list) or not segments:
        return ((1, code_id(config.get("code"))),)
    return tuple((int(s.get("first-round") or 1), code_id(s.get("code")))
                 for s in segments if isinstance(s, Mapping))


def _train_sizes(run_dir: Path) -> dict[str, int]:
    """Training images per partition id from the run's partition file, {} without one."""
    try:
        counts = load_partition_counts(run_dir)["train_counts"]
    except DataError:
        return {}
    return {str(k): int(row.sum()) for k, row in enumerate(counts)}


def load_records(grid_dir: str | Path, cells: Sequence[Mapping[str, Any]] | None = None,
                 clients: int | None = None) -> list[ResultRecord]:
    """One record per cell of a grid folder.

    The cells come from ``cells`` (a grid's expansion, run with ``clients``
    simulated clients), else the folder's ``grid.json``, else every sub-folder
    holding a ``config.json``; cells without results become ``missing`` records, so
    that tables show them as ``—``.
    """
    grid_dir = Path(grid_dir)
    if cells is None:
        grid = read_json(grid_dir / GRID_JSON)
        if isinstance(grid, dict) and isinstance(grid.get("cells"), list):
            cells = grid["cells"]
            simulation = grid.get("simulation")
            found = simulation.get("clients") if isinstance(simulation, dict) else None
            clients = found if isinstance(found, int) else None
    failures = read_failures(grid_dir)
    if cells is not None:
        return [read_record(grid_dir / str(cell["name"]), cell, clients=clients,
                            failed=str(cell["name"]) in failures) for cell in cells]
    folders = sorted(p.parent for p in grid_dir.glob("*/config.json"))
    if not folders:
        raise DataError(f"no grid.json and no run folders in {grid_dir}")
    return [read_record(folder, failed=folder.name in failures) for folder in folders]


# ---------------------------------------------------------------------- statistics
@dataclass(frozen=True)
class Stat:
    """Mean and sample standard deviation (None below two values) of ``n`` values."""

    mean: float | None
    std: float | None
    n: int

    def text(self) -> str:
        """``45.12 ± 0.34``, ``45.12`` for one value, ``—`` for none."""
        if self.mean is None:
            return MISSING
        if self.std is None:
            return f"{self.mean:.2f}"
        return f"{self.mean:.2f} ± {self.std:.2f}"


def summarize(values: Iterable[float]) -> Stat:
    values = [float(v) for v in values]
    if not values:
        return Stat(None, None, 0)
    std = statistics.stdev(values) if len(values) > 1 else None
    return Stat(statistics.fmean(values), std, len(values))


def delta_text(delta: float | None) -> str:
    """``+1.23`` / ``-0.34`` / ``—``."""
    return MISSING if delta is None else f"{delta:+.2f}"


def paired_delta(records: Iterable[ResultRecord], *, method: str, alpha: float | None,
                 setting: str, metric: str = "final") -> float | None:
    """Δ = +FedSPC − Base of a cell's mean accuracy (%) over the seeds both sides
    have a complete run of (a seed fixes the partition, the initial model and the
    batch order); None when no seed has both. With the same seeds on both sides it
    is the difference of the two cells' means."""
    records = list(records)
    base, spc = (cell_runs(records, method=method, fedspc=fedspc, alpha=alpha,
                           setting=setting, metric=metric) for fedspc in (False, True))
    return delta_over_shared_seeds(base, spc, metric=metric)


def seed_deltas(records: Iterable[ResultRecord], *, method: str, alpha: float | None,
                setting: str, metric: str = "final") -> list[tuple[int, float]]:
    """(seed, Δ) for each seed with a complete Base and +FedSPC run of the cell, where
    Δ is that seed's +FedSPC accuracy minus its Base accuracy (points)."""
    records = list(records)
    base, spc = ({r.seed: _accuracy(r, metric)
                  for r in cell_runs(records, method=method, fedspc=fedspc, alpha=alpha,
                                     setting=setting, metric=metric)}
                 for fedspc in (False, True))
    return [(seed, spc[seed] - base[seed]) for seed in sorted(set(base) & set(spc))]


def seed_delta_curves(records: Iterable[ResultRecord], *, method: str, alpha: float | None,
                      setting: str) -> dict[int, dict[int, float]]:
    """{seed: {round: Δ}} for each seed with a complete Base and +FedSPC run of the
    cell, Δ being that round's +FedSPC accuracy minus the Base's (points), on the
    rounds both runs evaluated; a seed whose runs share no round is left out."""
    records = list(records)
    base, spc = ({r.seed: dict(r.curve)
                  for r in cell_runs(records, method=method, fedspc=fedspc, alpha=alpha,
                                     setting=setting)}
                 for fedspc in (False, True))
    curves = {seed: {step: 100.0 * (spc[seed][step] - base[seed][step])
                     for step in sorted(set(base[seed]) & set(spc[seed]))}
              for seed in sorted(set(base) & set(spc))}
    return {seed: curve for seed, curve in curves.items() if curve}


def delta_over_shared_seeds(base: Sequence[ResultRecord], spc: Sequence[ResultRecord], *,
                            metric: str = "final") -> float | None:
    """Mean accuracy (%) of ``spc`` minus that of ``base``, both restricted to the
    seeds the two lists share; None when they share none."""
    seeds = {r.seed for r in base} & {r.seed for r in spc}
    if not seeds:
        return None
    base_stat, spc_stat = (runs_stat((r for r in side if r.seed in seeds), metric=metric)
                           for side in (base, spc))
    return spc_stat.mean - base_stat.mean


def _accuracy(record: ResultRecord, metric: str) -> float | None:
    """Accuracy (%) of ``record`` for ``metric``: ``final``, ``best`` or ``held-out``
    (the held-out clients' in the last evaluated round)."""
    value = {"final": record.final_accuracy, "best": record.best_accuracy,
             HELD_OUT: record.held_out_accuracy}[metric]
    return None if value is None else 100.0 * value


def cell_runs(records: Iterable[ResultRecord], *, method: str, fedspc: bool,
              alpha: float | None, setting: str, metric: str = "final",
              kind: str = FEDERATED) -> list[ResultRecord]:
    """The complete runs of one table cell that have an accuracy for ``metric``."""
    return [r for r in records
            if r.complete and r.kind == kind and r.method == method and r.fedspc == fedspc
            and r.setting == setting and (kind == CENTRALIZED or same_alpha(r.alpha, alpha))
            and _accuracy(r, metric) is not None]


def cell_stat(records: Iterable[ResultRecord], *, method: str, fedspc: bool,
              alpha: float | None, setting: str, metric: str = "final",
              kind: str = FEDERATED) -> Stat:
    """Accuracy (%) over the seeds of one table cell (complete runs only)."""
    return runs_stat(cell_runs(records, method=method, fedspc=fedspc, alpha=alpha,
                               setting=setting, metric=metric, kind=kind), metric=metric)


def runs_stat(runs: Iterable[ResultRecord], *, metric: str = "final") -> Stat:
    """Accuracy (%) over ``runs``: mean, standard deviation and count."""
    return summarize(_accuracy(r, metric) for r in runs)


def split_of(run_config: Mapping[str, Any]) -> float | str | None:
    """The row key of a federated run's split: its Dirichlet α, or ``"S classes/client"``
    for a class-count split (whose α the run-config carries but does not use)."""
    if run_config.get("partition") == "classes":
        return f"{run_config.get('classes-per-client')} classes/client"
    alpha = run_config.get("alpha")
    return None if alpha is None else float(alpha)


def same_alpha(a: float | str | None, b: float | str | None) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return a is not None and b is not None and math.isclose(a, b)


def unique(items: Iterable[Any]) -> list[Any]:
    out: list[Any] = []
    for item in items:
        if item not in out:
            out.append(item)
    return out


def settings_of(records: Sequence[ResultRecord], kind: str = FEDERATED) -> list[str]:
    """Settings in order of first appearance."""
    return unique(r.setting for r in records if r.kind == kind)


def alphas_of(records: Iterable[ResultRecord]) -> list[float | str]:
    """The splits of the federated records: Dirichlet α ascending, then class-count
    splits by classes per client."""
    return sorted({r.alpha for r in records if r.kind == FEDERATED and r.alpha is not None},
                  key=_split_order)


def _split_order(split: float | str) -> tuple[int, float, str]:
    if isinstance(split, str):
        count = split.split()[0]
        return 1, float(count) if count.isdigit() else math.inf, split
    return 0, split, ""


def methods_of(records: Iterable[ResultRecord]) -> list[str]:
    """Base methods, the paper's order first, then others as they appear."""
    seen = unique(r.method for r in records if r.kind == FEDERATED)
    return [m for m in METHOD_NAMES if m in seen] + [m for m in seen if m not in METHOD_NAMES]


def alpha_text(alpha: float | str) -> str:
    """``0.01``, ``0.1``, ``1.0`` as the paper writes them; a class-count split as
    ``5 classes/client``."""
    return alpha if isinstance(alpha, str) else repr(float(alpha))


def split_title(alpha: float | str) -> str:
    """``α = 0.1`` or ``5 classes/client``, for plot titles."""
    return alpha if isinstance(alpha, str) else f"α = {alpha_text(alpha)}"


def split_slug(alpha: float | str) -> str:
    """``a0.1`` or ``c5``, for file names."""
    return f"c{alpha.split()[0]}" if isinstance(alpha, str) else f"a{alpha:g}"


def mean_curve(records: Iterable[ResultRecord], series: str | None = None
               ) -> tuple[list[int], list[float], list[float]]:
    """Rounds, mean accuracy (%) and its sample std (0 for one run) across records;
    with ``series``, the mean and std of that per-round metric instead, over the
    records that recorded it at all. Only the rounds each of those has count: a round
    one run did not record (a failed round is not evaluated) would otherwise be the
    mean of the others, another set of seeds."""
    by_round: dict[int, list[float]] = {}
    holders = 0
    for record in records:
        points = record.curve if series is None else record.series.get(series, ())
        scale = 100.0 if series is None else 1.0
        holders += bool(points)
        for step, value in points:
            by_round.setdefault(step, []).append(scale * value)
    steps = sorted(step for step, values in by_round.items() if len(values) == holders)
    stats = [summarize(by_round[s]) for s in steps]
    return steps, [s.mean for s in stats], [s.std or 0.0 for s in stats]
