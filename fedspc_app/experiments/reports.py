"""The report of a grid: the paper's Tables 1 and 3 and the other tables, in
Markdown and CSV, with the figures, in ``<grid folder>/report/``.

* Table 1 (:func:`table1`): rows method × α, one column per setting, final-round
  accuracy (%).
* Table 3 (:func:`table3`): rows PFL method × α; per setting Base, +FedSPC and
  Δ = +FedSPC − Base.
* Pairs (:func:`pairs_table`): Base vs +FedSPC over the whole run.
* Clients (:func:`clients_table`): Base vs +FedSPC client by client.
* Drift (:func:`drift_table`): the shared block's drift diagnostics, the clients'
  train loss and what averaging cost them, averaged over the two halves of a run.
* With several seeds a value is ``mean ± std`` (sample std) and Δ the difference
  of the means over the seeds both Base and +FedSPC ran; a cell without a
  finished run shows ``—``.
"""

from __future__ import annotations

import csv
import io
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedspc_app.core.files import atomic_write
from fedspc_app.experiments.layout import slug
from fedspc_app.experiments.plots import (
    plot_curves,
    plot_delta_curves,
    plot_deltas,
    plot_drift,
    plot_partition_panels,
)
from fedspc_app.experiments.records import (
    BEFORE_AGGREGATION,
    CENTRALIZED,
    FEDERATED,
    HELD_OUT,
    LOCAL,
    MISSING,
    STALE,
    ResultRecord,
    alpha_text,
    alphas_of,
    cell_runs,
    cell_stat,
    delta_over_shared_seeds,
    delta_text,
    display_method,
    mean_curve,
    methods_of,
    runs_stat,
    same_alpha,
    settings_of,
    split_slug,
    split_title,
)
from fedspc_app.runs.results import format_duration


# -------------------------------------------------------------------------- tables
@dataclass(frozen=True)
class Table:
    """A table twice: display strings (Markdown, with notes under it) and numbers,
    one row per value (CSV: floats rounded to 4 decimals, "" = none)."""

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

    ``metric`` is ``"final"`` (final-round accuracy, the paper's) or ``"best"``. With
    held-out clients (``held-out-clients``) the final table adds each setting's
    held-out accuracy (the clients that never trained, last evaluated round).
    """
    settings = settings_of(records)
    federated = [r for r in records if r.kind == FEDERATED]
    held = _has_held_out(federated, metric)
    rows, csv_rows = [], []
    for method in methods_of(federated):
        for fedspc in (False, True):
            for alpha in alphas_of(r for r in federated
                                   if r.method == method and r.fedspc == fedspc):
                label = display_method(method) + ("+FedSPC" if fedspc else "")
                row = [label, alpha_text(alpha)]
                for setting in settings:
                    stats = [cell_stat(federated, method=method, fedspc=fedspc, alpha=alpha,
                                       setting=setting, metric=m)
                             for m in ((metric, HELD_OUT) if held else (metric,))]
                    row += [stat.text() for stat in stats]
                    csv_rows.append([display_method(method), str(fedspc).lower(),
                                     alpha_text(alpha), setting,
                                     *[v for stat in stats
                                       for v in (_num(stat.mean), _num(stat.std), stat.n)]])
                rows.append(row)
    columns = [c for setting in settings
               for c in ((setting, f"{setting} held out") if held else (setting,))]
    return Table(columns=["Method", "α", *columns], rows=rows,
                 numeric=(False, False, *[True] * len(columns)),
                 csv_columns=["method", "fedspc", "alpha", "setting", "accuracy", "std", "n",
                              *(("held_out", "held_out_std", "held_out_n") if held else ())],
                 csv_rows=csv_rows, notes=tuple(
                     ([HELD_OUT_NOTE] if held else [])
                     + centralized_lines(records, metric=metric)))


HELD_OUT_NOTE = ("\"held out\": the mean accuracy of the clients that never trained "
                 "(held-out-clients), each tested after fine-tuning from the final shared "
                 "block (held-out-parts, held-out-epochs).")


def _has_held_out(records: Sequence[ResultRecord], metric: str) -> bool:
    """Whether a final-accuracy table gets held-out columns: some run has them."""
    return metric == "final" and any(r.held_out_accuracy is not None for r in records)


def table3(records: Sequence[ResultRecord], *, metric: str = "final") -> Table:
    """Table 3 format: rows PFL method × α; per setting Base, +FedSPC and Δ (and, with
    held-out clients in a final table, the same three for their accuracy).

    Methods appear when some cell runs them with FedSPC.
    """
    settings = settings_of(records)
    federated = [r for r in records if r.kind == FEDERATED]
    methods = [m for m in methods_of(federated) if any(r.method == m and r.fedspc
                                                        for r in federated)]
    held = _has_held_out(federated, metric)
    metrics = (metric, HELD_OUT) if held else (metric,)
    columns = ["Method", "α"]
    for setting in settings:
        for m in metrics:
            name = setting if m == metric else f"{setting} held out"
            columns += [f"{name} Base", f"{name} +FedSPC", f"{name} Δ"]
    rows, csv_rows, uneven = [], [], []
    for method in methods:
        for alpha in alphas_of(r for r in federated if r.method == method):
            row = [display_method(method), alpha_text(alpha)]
            for setting in settings:
                numbers = []
                for m in metrics:
                    sides = [cell_runs(federated, method=method, fedspc=flag, alpha=alpha,
                                       setting=setting, metric=m) for flag in (False, True)]
                    base, spc = (runs_stat(side, metric=m) for side in sides)
                    seeds = [sorted({r.seed for r in side}) for side in sides]
                    if m == metric and seeds[0] and seeds[1] and seeds[0] != seeds[1]:
                        uneven.append(f"{display_method(method)} α {alpha_text(alpha)} "
                                      f"{setting} (Base seeds {_seed_list(seeds[0])}, "
                                      f"+FedSPC {_seed_list(seeds[1])})")
                    delta = delta_over_shared_seeds(*sides, metric=m)
                    row += [base.text(), spc.text(), delta_text(delta)]
                    numbers += [_num(base.mean), _num(base.std), base.n,
                                _num(spc.mean), _num(spc.std), spc.n, _num(delta)]
                csv_rows.append([display_method(method), alpha_text(alpha), setting,
                                 *numbers])
            rows.append(row)
    return Table(columns=columns, rows=rows,
                 numeric=(False, False, *[True] * (len(columns) - 2)),
                 csv_columns=["method", "alpha", "setting", "base", "base_std", "base_n",
                              "fedspc", "fedspc_std", "fedspc_n", "delta",
                              *(("held_out_base", "held_out_base_std", "held_out_base_n",
                                 "held_out_fedspc", "held_out_fedspc_std",
                                 "held_out_fedspc_n", "held_out_delta") if held else ())],
                 csv_rows=csv_rows, notes=tuple(
                     ([UNEVEN_NOTE + "; ".join(uneven) + "."] if uneven else [])
                     + ([HELD_OUT_NOTE] if held else [])
                     + local_lines(federated, metric=metric)
                     + centralized_lines(records, metric=metric)))


UNEVEN_NOTE = ("Δ is over the seeds both Base and +FedSPC ran (a seed fixes the partition, "
               "the initial model and the batch order), so it can differ from the "
               "difference of the two means shown in: ")


def _seed_list(seeds: Sequence[int]) -> str:
    return ", ".join(str(seed) for seed in seeds)


def pairs_table(records: Sequence[ResultRecord], *, window: int = 5) -> Table:
    """Base vs +FedSPC over the whole run, not only at the final round.

    For each method × α × setting, Base and +FedSPC are compared on the seeds
    both have a complete run of (a seed fixes the partition, the initial model and
    the batch order, so a difference is only meaningful between runs of one seed);
    runs whose seed has no partner are left out and named in a note. The
    seed-mean curves are compared on the rounds both recorded: Δ at the final
    round, Δ of the mean over the last ``window`` of those rounds, Δ of the best
    round, in how many rounds +FedSPC is ahead of (or behind) Base, and the final
    Δ of each seed. One seed's final round can be noise; the window, the counts
    and the per-seed values show whether a difference holds.
    """
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    rows, csv_rows, notes = [], [], []
    pairs = _pairs(records)
    for pair in pairs:
        base, spc = _curve(pair.base), _curve(pair.spc)
        common = sorted(set(base) & set(spc))
        if not common:
            continue
        last = common[-1]
        tail = common[-window:]
        final = spc[last] - base[last]
        tail_delta = (statistics.fmean(spc[s] for s in tail)
                      - statistics.fmean(base[s] for s in tail))
        best = max(spc[s] for s in common) - max(base[s] for s in common)
        ahead = sum(spc[s] > base[s] for s in common)
        behind = sum(spc[s] < base[s] for s in common)
        by_seed = [_seed_delta(pair.base, pair.spc, seed, last) for seed in pair.seeds]
        code, code_notes = pair_code(pair)
        rows.append([*pair.key, str(last), f"{base[last]:.2f}", f"{spc[last]:.2f}",
                     delta_text(final), delta_text(tail_delta), delta_text(best),
                     f"{ahead} / {behind}", str(len(pair.seeds)),
                     " / ".join(delta_text(d) for d in by_seed), code])
        csv_rows.append([*pair.key, last, len(tail), _num(base[last]), _num(spc[last]),
                         _num(final), _num(tail_delta), _num(best), ahead, behind,
                         " ".join(str(seed) for seed in pair.seeds),
                         " ".join(str(_num(d)) for d in by_seed), code])
        notes.extend(code_notes)
    notes = (*_unpaired_note(pairs), *notes)
    return Table(
        columns=["Method", "α", "Setting", "Round", "Base", "+FedSPC", "Δ final",
                 f"Δ last {window}", "Δ best", "Rounds ahead / behind", "Seeds",
                 "Δ final by seed", "Code"],
        rows=rows, numeric=(False, False, False, *[True] * 9, False),
        csv_columns=["method", "alpha", "setting", "round", "window", "base", "fedspc",
                     "delta_final", "delta_window", "delta_best", "rounds_ahead",
                     "rounds_behind", "seeds", "delta_final_by_seed", "code"],
        csv_rows=csv_rows, notes=notes)


@dataclass(frozen=True)
class _Pair:
    """Base and +FedSPC runs of one method × α × setting on the seeds both ran."""

    key: tuple[str, str, str]  # display method, α text, setting
    seeds: list[int]
    base: list[ResultRecord]
    spc: list[ResultRecord]
    unpaired: list[str]  # names of runs whose seed the other side lacks


def _pairs(records: Sequence[ResultRecord]) -> list[_Pair]:
    """Every method × α × setting with complete Base and +FedSPC runs of a common
    seed (a seed fixes the partition, the initial model and the batch order, so a
    difference is only meaningful between runs of one seed)."""
    federated = [r for r in records if r.kind == FEDERATED and r.complete and r.curve]
    pairs = []
    for setting in settings_of(federated):
        for method in methods_of(federated):
            for alpha in alphas_of(r for r in federated if r.method == method):
                sides = [[r for r in federated if r.method == method and r.fedspc == fedspc
                          and r.setting == setting and same_alpha(r.alpha, alpha)]
                         for fedspc in (False, True)]
                seeds = sorted({r.seed for r in sides[0]} & {r.seed for r in sides[1]})
                if not seeds:
                    continue
                base, spc = ([r for r in side if r.seed in seeds] for side in sides)
                pairs.append(_Pair(
                    (display_method(method), alpha_text(alpha), setting), seeds, base, spc,
                    [r.name for side in sides for r in side if r.seed not in seeds]))
    return pairs


SAME_CODE, MIXED_CODE, UNRECORDED_CODE = "same", "mixed", "unrecorded"


def pair_code(pair: _Pair) -> tuple[str, list[str]]:
    """Whether each seed's Base and +FedSPC runs were made by one code version:
    ``mixed`` when two runs of a seed differ, or a run changed code mid-run;
    ``unrecorded`` when a run did not record its code (and none is known to differ);
    ``same`` otherwise. The notes name each mixed run or seed."""
    notes: list[str] = []
    unrecorded = False
    label = f"{pair.key[0]}, α = {pair.key[1]}, {pair.key[2]}"
    for seed in pair.seeds:
        runs = [r for r in (*pair.base, *pair.spc) if r.seed == seed]
        for run in runs:
            if run.code_changed_at:
                rounds = ", ".join(str(first) for first in run.code_changed_at)
                notes.append(f"Mixed code: {run.name} went on under other code from "
                             f"round {rounds}.")
        ids = set().union(*(run.code_ids for run in runs))
        unrecorded = unrecorded or None in ids
        recorded = {code for code in ids if code is not None}
        if len(recorded) > 1 and not any(run.code_changed_at for run in runs):
            notes.append(f"Mixed code: {label}, seed {seed}: "
                         + " vs ".join(f"{run.name} ({_codes(run)})" for run in runs) + ".")
        elif len(recorded) > 1:
            notes.append(f"Mixed code: {label}, seed {seed}: its runs were made by "
                         f"{len(recorded)} code versions.")
    if notes:
        return MIXED_CODE, notes
    return (UNRECORDED_CODE if unrecorded else SAME_CODE), notes


def _codes(run: ResultRecord) -> str:
    return ", ".join("unrecorded" if code is None else f"source {code[:8]}"
                     for code in dict.fromkeys(code for _, code in run.code))


def _unpaired_note(pairs: Sequence[_Pair]) -> tuple[str, ...]:
    names = [name for pair in pairs for name in pair.unpaired]
    if not names:
        return ()
    return ("Left out, no run of the other side with the same seed: "
            + ", ".join(names) + ".",)


def _curve(runs: Sequence[ResultRecord]) -> dict[int, float]:
    steps, mean, _ = mean_curve(runs)
    return dict(zip(steps, mean))


def _averaging_gap(runs: Sequence[ResultRecord]) -> dict[int, float]:
    """Accuracy before aggregation minus after it (points) by round: each run's gap,
    then their mean on the rounds every run that recorded both has."""
    gaps = []
    for run in runs:
        before, after = dict(run.series.get(BEFORE_AGGREGATION, ())), dict(run.curve)
        if before:
            gaps.append({s: 100.0 * (before[s] - after[s]) for s in before if s in after})
    if not gaps:
        return {}
    common = set.intersection(*(set(gap) for gap in gaps))
    return {s: statistics.fmean(gap[s] for gap in gaps) for s in sorted(common)}


def _client_means(runs: Sequence[ResultRecord]) -> dict[str, float]:
    """Each client's accuracy (%) in the last evaluated round, mean over ``runs``."""
    values: dict[str, list[float]] = {}
    for run in runs:
        for k, accuracy in run.client_accuracy.items():
            values.setdefault(k, []).append(100.0 * accuracy)
    return {k: statistics.fmean(v) for k, v in values.items()}


def _seed_delta(base_runs: Sequence[ResultRecord], spc_runs: Sequence[ResultRecord],
                seed: int, step: int) -> float | None:
    """+FedSPC − Base at ``step`` for one seed (the mean of its runs on each side)."""
    base, spc = (_curve([r for r in runs if r.seed == seed]) for runs in (base_runs, spc_runs))
    if step not in base or step not in spc:
        return None
    return spc[step] - base[step]


def clients_table(records: Sequence[ResultRecord]) -> Table:
    """Base vs +FedSPC client by client, in the last evaluated round.

    A seed fixes the partition, so a Base and a +FedSPC run of one seed have the
    same clients; for every client of every paired seed Δ_k = its +FedSPC accuracy
    − its Base accuracy (points; the mean of a side's runs of that seed when it
    has several). The row counts the clients ahead and behind,
    gives the mean (which is the pair's Δ of personalized accuracy), median and
    range of Δ_k, and the mean Δ_k of the smaller and the larger half of each
    seed's clients by training images (the middle client of an odd count in
    neither), to show whether the correction pays for small or large clients.
    """
    rows, csv_rows, mismatched = [], [], []
    pairs = _pairs(records)
    for pair in pairs:
        deltas: list[float] = []
        small: list[float] = []
        large: list[float] = []
        used = 0
        for seed in pair.seeds:
            runs = [r for r in pair.base + pair.spc if r.seed == seed]
            sizes = runs[0].client_train_sizes
            if any(r.client_train_sizes != sizes for r in runs):
                mismatched.append(" / ".join(r.name for r in runs))
                continue
            base = _client_means([r for r in pair.base if r.seed == seed])
            spc = _client_means([r for r in pair.spc if r.seed == seed])
            delta = {k: spc[k] - base[k] for k in sorted(set(base) & set(spc))}
            if not delta:
                continue
            deltas += delta.values()
            used += 1
            sized = sorted((k for k in delta if k in sizes), key=lambda k: (sizes[k], k))
            half = len(sized) // 2
            small += [delta[k] for k in sized[:half]]
            large += [delta[k] for k in sized[len(sized) - half:]] if half else []
        if not deltas:
            continue
        stats = [statistics.fmean(deltas), statistics.median(deltas), min(deltas),
                 max(deltas), statistics.fmean(small) if small else None,
                 statistics.fmean(large) if large else None]
        ahead = sum(d > 0 for d in deltas)
        behind = sum(d < 0 for d in deltas)
        rows.append([*pair.key, str(used), str(len(deltas)),
                     f"{ahead} / {behind}", *(delta_text(v) for v in stats)])
        csv_rows.append([*pair.key, used, len(deltas), ahead, behind,
                         *(_num(v) for v in stats)])
    notes = _unpaired_note(pairs)
    if mismatched:
        notes += ("Left out, the two runs' partitions differ: " + ", ".join(mismatched)
                  + ".",)
    return Table(
        columns=["Method", "α", "Setting", "Seeds", "Clients", "Clients ahead / behind",
                 "Mean Δ_k", "Median Δ_k", "Min Δ_k", "Max Δ_k", "Smaller half",
                 "Larger half"],
        rows=rows, numeric=(False, False, False, *[True] * 9),
        csv_columns=["method", "alpha", "setting", "seeds", "clients", "clients_ahead",
                     "clients_behind", "mean", "median", "min", "max", "smaller_half",
                     "larger_half"],
        csv_rows=csv_rows, notes=notes)


# (series, column, format) of the drift table, in its column order.
DRIFT_TABLE_COLUMNS = (
    ("drift-dispersion", "Dispersion", "{:.2f}"),
    ("update-cosine", "Cosine", "{:.2f}"),
    ("update-norm", "‖mean Δ‖", "{:.3f}"),
    ("client-update-norm", "mean ‖Δ_k‖", "{:.3f}"),
    ("global-reference-norm", "‖ū‖", "{:.3f}"),
    ("train-loss", "Train loss", "{:.3f}"),
)
AVERAGING_GAP = "averaging-gap"
DRIFT_NOTE = (
    "Means over the rounds of each window of the seed-mean per-round values. "
    "Dispersion: mean_k ‖Δ_k − mean Δ‖² / ‖mean Δ‖² of the shared block's "
    "updates; cosine: mean_k cos(Δ_k, mean Δ); ‖ū‖: the global reference "
    "(FedSPC, SCAFFOLD); train loss: the clients' local training loss; "
    "averaging gap: accuracy before aggregation − after it, in points "
    "(positive: averaging cost the clients accuracy).")


def halves(last: int) -> list[tuple[int, int]]:
    """The round windows of the drift table: rounds 2..last//2 and the rest.

    Round 1 is left out (every client starts from the same model, with ū = 0), so
    20 rounds give (2, 10) and (11, 20); runs too short to halve get one window.
    """
    if last >= 4:
        return [(2, last // 2), (last // 2 + 1, last)]
    return [(min(2, last), last)] if last >= 1 else []


def _window_mean(points: dict[int, float], window: tuple[int, int]) -> float | None:
    values = [v for step, v in points.items() if window[0] <= step <= window[1]]
    return statistics.fmean(values) if values else None


def drift_table(records: Sequence[ResultRecord]) -> Table:
    """The drift diagnostics of the complete runs, Base and +FedSPC apart, as means
    over the two halves of a run.

    One row per setting × method × α × Base/+FedSPC × window (:func:`halves` of
    the last round): the seed-mean per-round values of the shared block's drift
    dispersion, mean cosine to the mean update, norm of the mean update, mean norm
    of the client updates, ‖ū‖ and the clients' train loss, each averaged over the
    window's rounds; and the averaging gap, accuracy before aggregation minus
    accuracy after it (points; runs with ``evaluate-before-aggregation``). ``—``
    where a run did not record the value.
    """
    federated = [r for r in records if r.kind == FEDERATED and r.complete and r.curve]
    rows, csv_rows = [], []
    for setting in settings_of(federated):
        for method in methods_of(federated):
            for alpha in alphas_of(r for r in federated if r.method == method):
                for fedspc in (False, True):
                    chosen = [r for r in federated if r.method == method
                              and r.fedspc == fedspc and r.setting == setting
                              and same_alpha(r.alpha, alpha)]
                    if not any(key in r.series for r in chosen
                               for key, _, _ in DRIFT_TABLE_COLUMNS[:4]):
                        continue
                    points = {key: dict(zip(*mean_curve(chosen, series=key)[:2]))
                              for key, _, _ in DRIFT_TABLE_COLUMNS}
                    points[AVERAGING_GAP] = _averaging_gap(chosen)
                    last = max(step for r in chosen for step, _ in r.curve)
                    for window in halves(last):
                        means = [_window_mean(points[key], window)
                                 for key, _, _ in DRIFT_TABLE_COLUMNS]
                        gap = _window_mean(points[AVERAGING_GAP], window)
                        label = display_method(method) + ("+FedSPC" if fedspc else "")
                        rounds = (f"{window[0]}–{window[1]}" if window[0] != window[1]
                                  else str(window[0]))
                        rows.append([label, alpha_text(alpha), setting, rounds, *(
                            MISSING if v is None else fmt.format(v)
                            for v, (_, _, fmt) in zip(means, DRIFT_TABLE_COLUMNS)),
                            delta_text(gap), str(len(chosen))])
                        csv_rows.append([display_method(method), str(fedspc).lower(),
                                         alpha_text(alpha), setting, window[0], window[1],
                                         *map(_num, means), _num(gap), len(chosen)])
    return Table(
        columns=["Run", "α", "Setting", "Rounds",
                 *(name for _, name, _ in DRIFT_TABLE_COLUMNS), "Averaging gap", "Seeds"],
        rows=rows, numeric=(False, False, False, *[True] * (len(DRIFT_TABLE_COLUMNS) + 3)),
        csv_columns=["method", "fedspc", "alpha", "setting", "first_round", "last_round",
                     *(key.replace("-", "_") for key, _, _ in DRIFT_TABLE_COLUMNS),
                     AVERAGING_GAP.replace("-", "_"), "n"],
        csv_rows=csv_rows,
        notes=(DRIFT_NOTE,))


def local_lines(federated: Sequence[ResultRecord], *, metric: str = "final") -> list[str]:
    """``Local, each client alone (α = 0.1, C-R34): 41.20%``: the reference of method
    ``local`` under Table 3 (Table 1 has it as a row)."""
    lines = []
    for alpha in alphas_of(r for r in federated if r.method == LOCAL):
        for setting in settings_of(federated):
            stat = cell_stat(federated, method=LOCAL, fedspc=False, alpha=alpha,
                             setting=setting, metric=metric)
            if stat.n:
                lines.append(f"Local, each client alone ({split_title(alpha)}, {setting}): "
                             f"{stat.text()}%")
    return lines


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
    """One row per cell: status, rounds, final and best accuracy, wall time (and the
    held-out clients' final accuracy when a run has them); a note names the stale
    runs and the settings they differ in."""
    held = any(r.held_out_accuracy is not None for r in records)
    rows, csv_rows = [], []
    for r in records:
        final = MISSING if r.final_accuracy is None else f"{100 * r.final_accuracy:.2f}"
        best = MISSING if r.best_accuracy is None else f"{100 * r.best_accuracy:.2f}"
        wall = MISSING if r.wall_seconds is None else format_duration(r.wall_seconds)
        code = _run_code(r)
        held_out = (MISSING if r.held_out_accuracy is None
                    else f"{100 * r.held_out_accuracy:.2f}")
        rows.append([r.name, r.status, MISSING if r.rounds is None else str(r.rounds),
                     final, best, MISSING if r.best_round is None else str(r.best_round),
                     *([held_out] if held else []), wall, code])
        csv_rows.append([r.name, r.kind, r.status, "" if r.rounds is None else r.rounds,
                         _num(None if r.final_accuracy is None else 100 * r.final_accuracy),
                         _num(None if r.best_accuracy is None else 100 * r.best_accuracy),
                         "" if r.best_round is None else r.best_round,
                         *([_num(None if r.held_out_accuracy is None
                                 else 100 * r.held_out_accuracy)] if held else []),
                         _num(r.wall_seconds), code])
    return Table(columns=["Run", "Status", "Rounds", "Final (%)", "Best (%)", "Best round",
                          *(["Held out (%)"] if held else []), "Wall time", "Code"],
                 rows=rows,
                 numeric=(False, False, True, True, True, True, *([True] if held else []),
                          True, False),
                 csv_columns=["run", "kind", "status", "rounds", "final", "best",
                              "best_round", *(["held_out"] if held else []),
                              "wall_seconds", "code"],
                 csv_rows=csv_rows, notes=_stale_note(records))


def _stale_note(records: Sequence[ResultRecord]) -> tuple[str, ...]:
    stale = [f"{r.name} ({', '.join(r.changes)})" for r in records if r.status == STALE]
    if not stale:
        return ()
    return ("Stale: finished under other settings than the grid's cell now (in "
            "parentheses), so no table counts them; delete a run's folder and run the "
            "grid again to rerun it: " + ", ".join(stale) + ".",)


def _run_code(record: ResultRecord) -> str:
    """``source 1a2b3c4d``, ``unrecorded``, or each segment's code and its first round
    when the run changed code mid-run."""
    if not record.code:
        return MISSING
    if not record.code_changed_at:
        return _codes(record)
    return "; ".join(f"from round {first}: "
                     + ("unrecorded" if code is None else f"source {code[:8]}")
                     for first, code in record.code) + " (mixed)"


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


# -------------------------------------------------------------------------- report
def write_report(records: Sequence[ResultRecord], out_dir: str | Path, *,
                 title: str = "") -> list[Path]:
    """Write every table as ``<stem>.md`` and ``<stem>.csv`` (table1, best, table3
    and pairs when some cell uses FedSPC, centralized when there are references,
    runs), the figures and ``report.md`` holding all of them; return the files."""
    out_dir = Path(out_dir)
    written: list[Path] = []
    tables: list[tuple[str, str, Table]] = [
        ("table1", "Final-round personalized accuracy (%), Table 1 format", table1(records)),
        ("best", "Best-round personalized accuracy (%)", table1(records, metric="best")),
    ]
    if any(r.kind == FEDERATED and r.fedspc for r in records):
        tables.insert(1, ("table3", ("Base vs +FedSPC, final round (%), Table 3 format; "
                                     "Δ = +FedSPC − Base"), table3(records)))
        tables.insert(2, ("pairs", ("Base vs +FedSPC over the run (seed means, %): Δ at "
                                    "the final round, over the last 5 rounds and at the "
                                    "best round; rounds where +FedSPC is ahead / behind"),
                          pairs_table(records)))
    clients = clients_table(records)
    if clients.rows:
        tables.insert(3, ("clients", ("Base vs +FedSPC client by client, last evaluated "
                                      "round: Δ_k = +FedSPC − Base (points)"), clients))
    drift = drift_table(records)
    if drift.rows:
        tables.append(("drift", ("Drift of the shared block, train loss and averaging "
                                 "gap, means over the two halves of the run"), drift))
    if any(r.kind == CENTRALIZED for r in records):
        tables.append(("centralized", "Centralized reference (pooled data, %)",
                       centralized_table(records)))
    tables.append(("runs", "Runs", runs_table(records)))

    figures: list[Path] = []
    for setting in settings_of(records):
        for alpha in alphas_of(r for r in records if r.setting == setting):
            for prefix, plot in (("curves", plot_curves), ("delta-curves", plot_delta_curves),
                                 ("drift", plot_drift)):
                path = plot(records, setting, alpha,
                            out_dir / f"{prefix}-{slug(setting)}-{split_slug(alpha)}.png")
                if path:
                    figures.append(path)
    panels, unreadable = plot_partition_panels(records, out_dir)
    figures += panels
    delta = plot_deltas(records, out_dir / "delta.png")
    if delta:
        figures.append(delta)

    seeds = sorted({r.seed for r in records})
    done = sum(r.complete for r in records)
    stale = sum(r.status == STALE for r in records)
    parts = [f"# Results{': ' + title if title else ''}", "",
             (f"{done} of {len(records)} cells complete"
              + (f" ({stale} stale: see Runs)" if stale else "")
              + f"; seeds {', '.join(map(str, seeds))}. "
              f"Values are mean ± sample std over seeds (the mean alone for one seed); "
              f"{MISSING} = not finished."), ""]
    for stem, heading, table in tables:
        markdown, text = to_markdown(table), to_csv(table)
        for suffix, content in (("md", markdown), ("csv", text)):
            atomic_write(out_dir / f"{stem}.{suffix}", content)
            written.append(out_dir / f"{stem}.{suffix}")
        parts += [f"## {heading}", "", markdown]
    if figures or unreadable:
        parts += ["## Figures", ""]
        parts += [f"![{p.stem}]({p.name})" for p in figures] + [""]
    if unreadable:
        parts += ["Left out of the partition heatmaps, their partition.json unreadable: "
                  + "; ".join(unreadable) + ".", ""]
    atomic_write(out_dir / "report.md", "\n".join(parts))
    return [*written, *figures, out_dir / "report.md"]
