"""Tables and figures from the results of an experiment grid (the paper's Tables 1 and 3).

Everything here works on a list of :class:`ResultRecord`, one per cell, read from
the cells' ``summary.json``, ``metrics.json`` and ``config.json`` by
:func:`load_records`; the table builders are pure functions of those records.

* Table 1 format (:func:`table1`): rows method × α, one column per setting
  (dataset-model), final-round personalized accuracy (%).
* Table 3 format (:func:`table3`): rows PFL method × α; per setting the columns
  Base, +FedSPC and Δ = +FedSPC − Base.
* Pairs (:func:`pairs_table`): Base vs +FedSPC over the whole run (Δ at the final
  round, over the last rounds and at the best round; rounds ahead and behind).
* With several seeds a value is ``mean ± std`` (sample std, ddof = 1) and Δ is the
  difference of the means; a cell without a finished run shows ``—``.

:func:`write_report` writes them as Markdown and CSV, with the best-round table, a
per-run table, the centralized references and the figures (accuracy per round,
partition heatmaps, Δ bars).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedspc_app.core.errors import DataError
from fedspc_app.core.files import atomic_write
from fedspc_app.core.results import format_duration

MISSING = "—"
METHOD_NAMES = {
    "fedavg": "FedAvg", "fedprox": "FedProx", "scaffold": "SCAFFOLD", "ditto": "Ditto",
    "fedbabu": "FedBABU", "fedrep": "FedRep", "lgfedavg": "LG-FedAvg", "fedper": "FedPer",
}
"""Display names, in the paper's row order (Table 1)."""

FEDERATED = "federated"
CENTRALIZED = "centralized"


# ------------------------------------------------------------------------ records
@dataclass(frozen=True)
class ResultRecord:
    """What the report needs to know about one cell.

    Attributes
    ----------
    name : str
        Run-name.
    kind : str
        ``"federated"`` or ``"centralized"``.
    method : str
        Base method (``fedrep``), or ``centralized``.
    fedspc : bool
        Whether FedSPC was added.
    alpha : float | None
        Dirichlet α (None for centralized runs).
    seed : int
    setting : str
        Table column (e.g. ``C-R34`` or ``cifar100-cnn``).
    dataset : str
    status : str
        ``complete``, ``partial`` (started, not finished), ``failed`` or ``missing``.
    rounds : int | None
        Rounds (epochs for centralized runs) recorded.
    final_accuracy, best_accuracy : float | None
        Fractions in [0, 1] (final: the last evaluated round).
    best_round : int | None
    wall_seconds : float | None
    curve : tuple of (int, float)
        ``(round or epoch, accuracy)`` pairs.
    run_dir : pathlib.Path | None
        The results folder (for its ``partition.json``).
    """

    name: str
    kind: str = FEDERATED
    method: str = ""
    fedspc: bool = False
    alpha: float | None = None
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

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    @property
    def label(self) -> str:
        """Display label, e.g. ``FedRep+FedSPC``."""
        return display_method(self.method) + ("+FedSPC" if self.fedspc else "")


def display_method(method: str) -> str:
    return METHOD_NAMES.get(method, method)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_record(run_dir: Path, cell: Mapping[str, Any] | None = None, *,
                failed: bool = False) -> ResultRecord:
    """The record of one results folder.

    Parameters
    ----------
    run_dir : pathlib.Path
        ``<grid dir>/<run-name>``; it may not exist yet (a missing cell).
    cell : mapping, optional
        The cell's entry of ``grid.json`` (name, kind, setting, run-config). Without
        it, everything comes from the folder's ``config.json`` and the setting is
        ``<dataset>-<model>``.
    failed : bool
        The cell is recorded as failed (shown when it did not finish).
    """
    config = _read_json(run_dir / "config.json")
    config = config if isinstance(config, dict) else {}
    if cell is not None:
        rc = dict(cell.get("run-config", {}))
        kind = cell.get("kind", FEDERATED)
        setting = cell.get("setting") or f"{rc.get('dataset')}-{rc.get('model')}"
    else:
        rc = dict(config.get("run-config", {}))
        kind = CENTRALIZED if config.get("mode") == CENTRALIZED else FEDERATED
        setting = f"{rc.get('dataset')}-{rc.get('model')}"
    summary = _read_json(run_dir / "summary.json")
    summary = summary if isinstance(summary, dict) else {}
    metrics = _read_json(run_dir / "metrics.json")
    metrics = metrics if isinstance(metrics, dict) else {}
    step = "epoch" if kind == CENTRALIZED else "round"
    rows = metrics.get("epochs" if kind == CENTRALIZED else "rounds") or []
    curve = tuple((int(r[step]), float(r["accuracy"])) for r in rows
                  if isinstance(r, dict) and isinstance(r.get("accuracy"), (int, float)))

    if summary.get("complete") is True:
        status = "complete"
    elif failed:
        status = "failed"
    elif config or rows:
        status = "partial"
    else:
        status = "missing"
    if status == "complete":
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
    alpha = rc.get("alpha")
    return ResultRecord(
        name=str(cell["name"]) if cell is not None else run_dir.name,
        kind=kind,
        method=CENTRALIZED if kind == CENTRALIZED else str(rc.get("method", "")),
        fedspc=kind != CENTRALIZED and bool(rc.get("fedspc", False)),
        alpha=None if kind == CENTRALIZED or alpha is None else float(alpha),
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
    )


def load_records(grid_dir: str | Path,
                 cells: Sequence[Mapping[str, Any]] | None = None) -> list[ResultRecord]:
    """One record per cell of a grid folder.

    The cells come from ``cells`` (a grid's expansion), else the folder's
    ``grid.json``, else every sub-folder holding a ``config.json``; cells without
    results become ``missing`` records, so that tables show them as ``—``.
    """
    from fedspc_app.experiments import FAILURES_JSON, GRID_JSON

    grid_dir = Path(grid_dir)
    if cells is None:
        grid = _read_json(grid_dir / GRID_JSON)
        if isinstance(grid, dict) and isinstance(grid.get("cells"), list):
            cells = grid["cells"]
    failures = _read_json(grid_dir / FAILURES_JSON)
    failures = failures if isinstance(failures, dict) else {}
    if cells is not None:
        return [read_record(grid_dir / str(cell["name"]), cell,
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


def _delta(base: Stat, spc: Stat) -> float | None:
    if base.mean is None or spc.mean is None:
        return None
    return spc.mean - base.mean


def _accuracy(record: ResultRecord, metric: str) -> float | None:
    value = record.final_accuracy if metric == "final" else record.best_accuracy
    return None if value is None else 100.0 * value


def cell_stat(records: Iterable[ResultRecord], *, method: str, fedspc: bool,
              alpha: float | None, setting: str, metric: str = "final",
              kind: str = FEDERATED) -> Stat:
    """Accuracy (%) over the seeds of one table cell (complete runs only)."""
    return summarize(
        acc for r in records
        if r.complete and r.kind == kind and r.method == method and r.fedspc == fedspc
        and r.setting == setting and (kind == CENTRALIZED or _same_alpha(r.alpha, alpha))
        and (acc := _accuracy(r, metric)) is not None)


def _same_alpha(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and math.isclose(a, b)


def _unique(items: Iterable[Any]) -> list[Any]:
    out: list[Any] = []
    for item in items:
        if item not in out:
            out.append(item)
    return out


def settings_of(records: Sequence[ResultRecord], kind: str = FEDERATED) -> list[str]:
    """Settings in order of first appearance."""
    return _unique(r.setting for r in records if r.kind == kind)


def alphas_of(records: Iterable[ResultRecord]) -> list[float]:
    return sorted({r.alpha for r in records if r.kind == FEDERATED and r.alpha is not None})


def methods_of(records: Iterable[ResultRecord]) -> list[str]:
    """Base methods, the paper's order first, then others as they appear."""
    seen = _unique(r.method for r in records if r.kind == FEDERATED)
    return [m for m in METHOD_NAMES if m in seen] + [m for m in seen if m not in METHOD_NAMES]


def alpha_text(alpha: float) -> str:
    """``0.01``, ``0.1``, ``1.0`` as the paper writes them."""
    return repr(float(alpha))


# -------------------------------------------------------------------------- tables
@dataclass(frozen=True)
class Table:
    """A table twice: display strings (Markdown) and numbers, one row per value (CSV).

    Attributes
    ----------
    columns, rows : list
        Header and rows of the Markdown view.
    numeric : tuple of bool
        Which Markdown columns are right-aligned.
    csv_columns, csv_rows : list
        Header and rows of the CSV view (floats rounded to 4 decimals, "" = none).
    notes : list of str
        Lines printed under the Markdown table (the centralized references).
    """

    columns: list[str]
    rows: list[list[str]]
    numeric: tuple[bool, ...]
    csv_columns: list[str]
    csv_rows: list[list[Any]]
    notes: tuple[str, ...] = ()


def _num(value: float | None) -> Any:
    return "" if value is None else round(value, 4)


def table1(records: Sequence[ResultRecord], *, metric: str = "final") -> Table:
    """Table 1 format: rows method (with +FedSPC variants) × α, columns settings.

    ``metric`` is ``"final"`` (final-round accuracy, the paper's) or ``"best"``.
    """
    settings = settings_of(records)
    federated = [r for r in records if r.kind == FEDERATED]
    rows, csv_rows = [], []
    for method in methods_of(federated):
        for fedspc in (False, True):
            for alpha in alphas_of(r for r in federated
                                   if r.method == method and r.fedspc == fedspc):
                label = display_method(method) + ("+FedSPC" if fedspc else "")
                row = [label, alpha_text(alpha)]
                for setting in settings:
                    stat = cell_stat(federated, method=method, fedspc=fedspc, alpha=alpha,
                                     setting=setting, metric=metric)
                    row.append(stat.text())
                    csv_rows.append([display_method(method), str(fedspc).lower(),
                                     alpha_text(alpha), setting, _num(stat.mean),
                                     _num(stat.std), stat.n])
                rows.append(row)
    return Table(columns=["Method", "α", *settings], rows=rows,
                 numeric=(False, False, *[True] * len(settings)),
                 csv_columns=["method", "fedspc", "alpha", "setting", "accuracy", "std", "n"],
                 csv_rows=csv_rows, notes=tuple(centralized_lines(records, metric=metric)))


def table3(records: Sequence[ResultRecord], *, metric: str = "final") -> Table:
    """Table 3 format: rows PFL method × α; per setting Base, +FedSPC and Δ.

    Methods appear when some cell runs them with FedSPC.
    """
    settings = settings_of(records)
    federated = [r for r in records if r.kind == FEDERATED]
    methods = [m for m in methods_of(federated) if any(r.method == m and r.fedspc
                                                        for r in federated)]
    columns = ["Method", "α"]
    for setting in settings:
        columns += [f"{setting} Base", f"{setting} +FedSPC", f"{setting} Δ"]
    rows, csv_rows = [], []
    for method in methods:
        for alpha in alphas_of(r for r in federated if r.method == method):
            row = [display_method(method), alpha_text(alpha)]
            for setting in settings:
                base, spc = (cell_stat(federated, method=method, fedspc=flag, alpha=alpha,
                                       setting=setting, metric=metric)
                             for flag in (False, True))
                delta = _delta(base, spc)
                row += [base.text(), spc.text(), delta_text(delta)]
                csv_rows.append([display_method(method), alpha_text(alpha), setting,
                                 _num(base.mean), _num(base.std), base.n,
                                 _num(spc.mean), _num(spc.std), spc.n, _num(delta)])
            rows.append(row)
    return Table(columns=columns, rows=rows,
                 numeric=(False, False, *[True] * (3 * len(settings))),
                 csv_columns=["method", "alpha", "setting", "base", "base_std", "base_n",
                              "fedspc", "fedspc_std", "fedspc_n", "delta"],
                 csv_rows=csv_rows, notes=tuple(centralized_lines(records, metric=metric)))


def pairs_table(records: Sequence[ResultRecord], *, window: int = 5) -> Table:
    """Base vs +FedSPC over the whole run, not only at the final round.

    For each method × α × setting with complete Base and +FedSPC runs, the
    seed-mean curves are compared on the rounds both recorded: Δ at the final
    round, Δ of the mean over the last ``window`` of those rounds, Δ of the best
    round, and in how many rounds +FedSPC is ahead of (or behind) Base. One seed's
    final round can be noise; the window and the counts show whether a difference
    holds over the run.
    """
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    federated = [r for r in records if r.kind == FEDERATED and r.complete and r.curve]
    rows, csv_rows = [], []
    for setting in settings_of(federated):
        for method in methods_of(federated):
            for alpha in alphas_of(r for r in federated if r.method == method):
                curves = []
                for fedspc in (False, True):
                    chosen = [r for r in federated if r.method == method
                              and r.fedspc == fedspc and r.setting == setting
                              and _same_alpha(r.alpha, alpha)]
                    steps, mean, _ = mean_curve(chosen)
                    curves.append((dict(zip(steps, mean)), len(chosen)))
                (base, n_base), (spc, n_spc) = curves
                common = sorted(set(base) & set(spc))
                if not common:
                    continue
                tail = common[-window:]
                final = spc[common[-1]] - base[common[-1]]
                tail_delta = (statistics.fmean(spc[s] for s in tail)
                              - statistics.fmean(base[s] for s in tail))
                best = max(spc[s] for s in common) - max(base[s] for s in common)
                ahead = sum(spc[s] > base[s] for s in common)
                behind = sum(spc[s] < base[s] for s in common)
                rows.append([display_method(method), alpha_text(alpha), setting,
                             str(common[-1]), f"{base[common[-1]]:.2f}",
                             f"{spc[common[-1]]:.2f}", delta_text(final),
                             delta_text(tail_delta), delta_text(best),
                             f"{ahead} / {behind}", f"{n_base} / {n_spc}"])
                csv_rows.append([display_method(method), alpha_text(alpha), setting,
                                 common[-1], len(tail), _num(base[common[-1]]),
                                 _num(spc[common[-1]]), _num(final), _num(tail_delta),
                                 _num(best), ahead, behind, n_base, n_spc])
    return Table(
        columns=["Method", "α", "Setting", "Round", "Base", "+FedSPC", "Δ final",
                 f"Δ last {window}", "Δ best", "Rounds ahead / behind", "Seeds"],
        rows=rows, numeric=(False, False, False, *[True] * 8),
        csv_columns=["method", "alpha", "setting", "round", "window", "base", "fedspc",
                     "delta_final", "delta_window", "delta_best", "rounds_ahead",
                     "rounds_behind", "base_n", "fedspc_n"],
        csv_rows=csv_rows)


def centralized_lines(records: Sequence[ResultRecord], *, metric: str = "final") -> list[str]:
    """``Centralized (C-R34): 79.57%`` for every setting with a centralized cell."""
    lines = []
    for setting in settings_of(records, CENTRALIZED):
        stat = cell_stat(records, method=CENTRALIZED, fedspc=False, alpha=None,
                         setting=setting, metric=metric, kind=CENTRALIZED)
        lines.append(f"Centralized ({setting}): " + (
            MISSING if stat.mean is None else f"{stat.text()}%"))
    return lines


def centralized_table(records: Sequence[ResultRecord]) -> Table:
    """The centralized references: final and best accuracy per setting."""
    rows, csv_rows = [], []
    for setting in settings_of(records, CENTRALIZED):
        final, best = (cell_stat(records, method=CENTRALIZED, fedspc=False, alpha=None,
                                 setting=setting, metric=m, kind=CENTRALIZED)
                       for m in ("final", "best"))
        rows.append([setting, final.text(), best.text()])
        csv_rows.append([setting, _num(final.mean), _num(final.std), _num(best.mean),
                         _num(best.std), final.n])
    return Table(columns=["Setting", "Final (%)", "Best (%)"], rows=rows,
                 numeric=(False, True, True),
                 csv_columns=["setting", "final", "final_std", "best", "best_std", "n"],
                 csv_rows=csv_rows)


def runs_table(records: Sequence[ResultRecord]) -> Table:
    """One row per cell: status, rounds, final and best accuracy, wall time."""
    rows, csv_rows = [], []
    for r in records:
        final = MISSING if r.final_accuracy is None else f"{100 * r.final_accuracy:.2f}"
        best = MISSING if r.best_accuracy is None else f"{100 * r.best_accuracy:.2f}"
        wall = MISSING if r.wall_seconds is None else format_duration(r.wall_seconds)
        rows.append([r.name, r.status, MISSING if r.rounds is None else str(r.rounds),
                     final, best, MISSING if r.best_round is None else str(r.best_round),
                     wall])
        csv_rows.append([r.name, r.kind, r.status, "" if r.rounds is None else r.rounds,
                         _num(None if r.final_accuracy is None else 100 * r.final_accuracy),
                         _num(None if r.best_accuracy is None else 100 * r.best_accuracy),
                         "" if r.best_round is None else r.best_round,
                         _num(r.wall_seconds)])
    return Table(columns=["Run", "Status", "Rounds", "Final (%)", "Best (%)", "Best round",
                          "Wall time"], rows=rows,
                 numeric=(False, False, True, True, True, True, True),
                 csv_columns=["run", "kind", "status", "rounds", "final", "best",
                              "best_round", "wall_seconds"],
                 csv_rows=csv_rows)


def to_markdown(table: Table) -> str:
    """The table as GitHub Markdown, followed by its notes."""
    lines = ["| " + " | ".join(table.columns) + " |",
             "| " + " | ".join("---:" if n else "---" for n in table.numeric) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in table.rows]
    if table.notes:
        lines += ["", *table.notes]
    return "\n".join(lines) + "\n"


def to_csv(table: Table) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(table.csv_columns)
    writer.writerows(table.csv_rows)
    return buffer.getvalue()


# ------------------------------------------------------------------------- figures
def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text).strip("_") or "_"


def _save_png(fig: Any, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    atomic_write(path, buffer.getvalue())
    return path


def mean_curve(records: Iterable[ResultRecord]) -> tuple[list[int], list[float], list[float]]:
    """Rounds, mean accuracy (%) and its sample std (0 for one run) across records."""
    by_round: dict[int, list[float]] = {}
    for record in records:
        for step, accuracy in record.curve:
            by_round.setdefault(step, []).append(100.0 * accuracy)
    steps = sorted(by_round)
    stats = [summarize(by_round[s]) for s in steps]
    return steps, [s.mean for s in stats], [s.std or 0.0 for s in stats]


def plot_curves(records: Sequence[ResultRecord], setting: str, alpha: float,
                path: str | Path) -> Path | None:
    """Accuracy per round for each method of one (setting, α), base and +FedSPC.

    One panel per method; the lines are means over seeds (shaded ± std). The
    centralized reference of the setting, when there is one, is a dashed line.
    Returns None when no cell of that (setting, α) has recorded a round.
    """
    from matplotlib.figure import Figure

    chosen = [r for r in records if r.kind == FEDERATED and r.setting == setting
              and _same_alpha(r.alpha, alpha) and r.curve]
    methods = methods_of(chosen)
    if not methods:
        return None
    reference = cell_stat(records, method=CENTRALIZED, fedspc=False, alpha=None,
                          setting=setting, kind=CENTRALIZED)
    cols = len(methods) if len(methods) <= 5 else 4
    rows = math.ceil(len(methods) / cols)
    fig = Figure(figsize=(3.4 * cols, 3.0 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, method in zip(axes, methods):
        for fedspc, colour, label in ((False, "C0", "Base"), (True, "C1", "+FedSPC")):
            steps, mean, std = mean_curve(r for r in chosen
                                          if r.method == method and r.fedspc == fedspc)
            if not steps:
                continue
            ax.plot(steps, mean, color=colour, label=label, marker="." if len(steps) < 30
                    else None)
            if any(std):
                ax.fill_between(steps, [m - s for m, s in zip(mean, std)],
                                [m + s for m, s in zip(mean, std)], color=colour, alpha=0.2)
        if reference.mean is not None:
            ax.axhline(reference.mean, color="0.4", linestyle="--", linewidth=1,
                       label="Centralized")
        ax.set_title(display_method(method))
        ax.set_xlabel("Round")
        ax.set_ylabel("Accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[len(methods):]:
        ax.set_visible(False)
    fig.suptitle(f"{setting}, α = {alpha_text(alpha)}")
    return _save_png(fig, Path(path))


def plot_deltas(records: Sequence[ResultRecord], path: str | Path) -> Path | None:
    """Bar chart of Δ (+FedSPC − Base, points) per method and α, one panel per setting.

    Returns None when no Δ can be computed yet.
    """
    from matplotlib.figure import Figure

    federated = [r for r in records if r.kind == FEDERATED]
    settings = settings_of(federated)
    methods = [m for m in methods_of(federated) if any(r.method == m and r.fedspc
                                                        for r in federated)]
    alphas = alphas_of(federated)
    values = {
        (s, m, a): _delta(*(cell_stat(federated, method=m, fedspc=f, alpha=a, setting=s)
                            for f in (False, True)))
        for s in settings for m in methods for a in alphas
    }
    if all(v is None for v in values.values()):
        return None
    fig = Figure(figsize=(max(4.0, 1.1 * len(methods) + 1.5) * len(settings), 3.4),
                 layout="constrained")
    axes = fig.subplots(1, len(settings), squeeze=False)[0]
    width = 0.8 / max(len(alphas), 1)
    for ax, setting in zip(axes, settings):
        for i, alpha in enumerate(alphas):
            heights = [values[setting, m, alpha] for m in methods]
            xs = [j + (i - (len(alphas) - 1) / 2) * width for j in range(len(methods))]
            shown = [(x, h) for x, h in zip(xs, heights) if h is not None]
            if not shown:  # an α without any Δ yet gets no bars and no legend entry
                continue
            bars = ax.bar([x for x, _ in shown], [h for _, h in shown], width=width,
                          label=f"α = {alpha_text(alpha)}", color=f"C{i}")
            ax.bar_label(bars, fmt="%+.2f", fontsize=7, padding=2)
        ax.margins(y=0.12)  # room for the value labels
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(methods)))
        ax.set_xticklabels([display_method(m) for m in methods], rotation=30, ha="right")
        ax.set_ylabel("Δ accuracy (points)")
        ax.set_title(setting)
        ax.grid(axis="y", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("FedSPC gain: +FedSPC − Base (final round)")
    return _save_png(fig, Path(path))


def plot_partition_panels(records: Sequence[ResultRecord], out_dir: str | Path) -> list[Path]:
    """The partitions of each dataset, one panel per α (the paper's Figures 3-4).

    For each α the cell with the smallest seed that wrote a ``partition.json`` is
    drawn with :func:`fedspc_app.core.partition.plot_partitions`.
    """
    from fedspc_app.core.partition import load_partition_counts, plot_partitions

    written = []
    for dataset in _unique(r.dataset for r in records if r.kind == FEDERATED):
        chosen: dict[float, ResultRecord] = {}
        for record in sorted((r for r in records if r.kind == FEDERATED
                              and r.dataset == dataset and r.alpha is not None
                              and r.run_dir is not None
                              and (r.run_dir / "partition.json").is_file()),
                             key=lambda r: r.seed):
            chosen.setdefault(record.alpha, record)
        if not chosen:
            continue
        panels, clients = [], set()
        for alpha in sorted(chosen):
            data = load_partition_counts(chosen[alpha].run_dir)
            clients.add(int(data["num_clients"]))
            panels.append((f"α = {alpha_text(alpha)}", data["train_counts"]))
        title = f"{dataset}: training images per client and class"
        if len(clients) == 1:
            title += f" ({clients.pop()} clients)"
        written.append(plot_partitions(panels, Path(out_dir) / f"partitions-{_slug(dataset)}.png",
                                       title=title))
    return written


# -------------------------------------------------------------------------- report
def write_report(records: Sequence[ResultRecord], out_dir: str | Path, *,
                 title: str = "") -> list[Path]:
    """Write every table (Markdown and CSV), the figures and ``report.md``.

    Files: ``table1.{md,csv}`` (final-round accuracy), ``best.{md,csv}`` (best-round
    accuracy), ``table3.{md,csv}`` and ``pairs.{md,csv}`` (when some cell uses FedSPC),
    ``centralized.{md,csv}`` (when there are centralized cells), ``runs.{md,csv}``,
    ``curves-<setting>-a<alpha>.png``, ``partitions-<dataset>.png``, ``delta.png``
    and ``report.md`` holding all of them.

    Returns
    -------
    list of pathlib.Path
        The files written.
    """
    out_dir = Path(out_dir)
    written: list[Path] = []
    tables: list[tuple[str, str, Table]] = [
        ("table1", "Final-round personalized accuracy (%), Table 1 format", table1(records)),
        ("best", "Best-round personalized accuracy (%)", table1(records, metric="best")),
    ]
    if any(r.kind == FEDERATED and r.fedspc for r in records):
        tables.insert(1, ("table3", "Base vs +FedSPC, final round (%), Table 3 format; "
                                    "Δ = +FedSPC − Base", table3(records)))
        tables.insert(2, ("pairs", "Base vs +FedSPC over the run (seed means, %): Δ at "
                                   "the final round, over the last 5 rounds and at the "
                                   "best round; rounds where +FedSPC is ahead / behind",
                          pairs_table(records)))
    if any(r.kind == CENTRALIZED for r in records):
        tables.append(("centralized", "Centralized reference (pooled data, %)",
                       centralized_table(records)))
    tables.append(("runs", "Runs", runs_table(records)))

    figures: list[Path] = []
    for setting in settings_of(records):
        for alpha in alphas_of(r for r in records if r.setting == setting):
            path = plot_curves(records, setting, alpha,
                               out_dir / f"curves-{_slug(setting)}-a{alpha:g}.png")
            if path:
                figures.append(path)
    figures += plot_partition_panels(records, out_dir)
    delta = plot_deltas(records, out_dir / "delta.png")
    if delta:
        figures.append(delta)

    seeds = sorted({r.seed for r in records})
    done = sum(r.complete for r in records)
    parts = [f"# Results{': ' + title if title else ''}", "",
             f"{done} of {len(records)} cells complete; seeds {', '.join(map(str, seeds))}. "
             f"Values are mean ± sample std over seeds (the mean alone for one seed); "
             f"{MISSING} = not finished.", ""]
    for stem, heading, table in tables:
        markdown, text = to_markdown(table), to_csv(table)
        for suffix, content in (("md", markdown), ("csv", text)):
            atomic_write(out_dir / f"{stem}.{suffix}", content)
            written.append(out_dir / f"{stem}.{suffix}")
        parts += [f"## {heading}", "", markdown]
    if figures:
        parts += ["## Figures", ""]
        parts += [f"![{p.stem}]({p.name})" for p in figures] + [""]
    atomic_write(out_dir / "report.md", "\n".join(parts))
    return [*written, *figures, out_dir / "report.md"]
