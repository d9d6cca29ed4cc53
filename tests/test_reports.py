"""Report tables and figures (fedspc_app.experiments) from small synthetic result folders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from matplotlib.collections import PathCollection

from fedspc_app.core.errors import ConfigError
from fedspc_app.data.partition import dirichlet_partition
from fedspc_app.data.partition_files import save_partition
from fedspc_app.experiments import cli, layout, plots, reports
from fedspc_app.experiments.records import (
    delta_text,
    load_records,
    paired_delta,
    seed_delta_curves,
    summarize,
)

PNG = b"\x89PNG\r\n\x1a\n"


def write_run(grid_dir: Path, name: str, *, setting: str, method: str = "fedrep",
              fedspc: bool = False, alpha: float = 0.1, seed: int = 0,
              final: float | None = None, best: float | None = None,
              curve: tuple[float, ...] = (), state: str = "complete",
              kind: str = "federated",
              series: dict[str, tuple[float | None, ...]] | None = None,
              extra: dict | None = None,
              segments: list[tuple[int, str | None]] | None = None) -> dict:
    """A results folder as a run leaves it; returns the cell's grid.json entry.

    ``state`` is ``complete`` (summary written), ``partial`` (config and metrics
    only) or ``missing`` (no folder). ``series`` adds per-round metrics (None: the
    round did not record it); ``extra``, run-config keys; ``segments``, the run's
    (first round, source hash) starts as config.json records them (none: unrecorded).
    """
    rc = {"dataset": "cifar100", "model": "cnn", "method": method, "fedspc": fedspc,
          "alpha": alpha, "seed": seed, "num-rounds": len(curve), **(extra or {})}
    cell = {"name": name, "kind": kind, "setting": setting, "run-config": rc}
    if state == "missing":
        return cell
    run_dir = grid_dir / name
    run_dir.mkdir(parents=True)
    config = {"run-config": rc, **({"mode": "centralized"} if kind == "centralized" else {})}
    if segments:
        config["segments"] = [{"first-round": first, "code": code and {"source-sha256": code}}
                              for first, code in segments]
        config["code"] = config["segments"][-1]["code"]
    (run_dir / "config.json").write_text(json.dumps(config))
    step = "epoch" if kind == "centralized" else "round"
    rows = [{step: i + 1, "accuracy": acc, "elapsed-seconds": 10.0 * (i + 1)}
            for i, acc in enumerate(curve)]
    for key, values in (series or {}).items():
        for row, value in zip(rows, values):
            if value is not None:
                row[key] = value
    (run_dir / "metrics.json").write_text(json.dumps(
        {"epochs" if kind == "centralized" else "rounds": rows}))
    if state == "complete":
        best_at = int(np.argmax(curve)) + 1 if curve else 1
        (run_dir / "summary.json").write_text(json.dumps({
            "complete": True, "rounds": len(curve), "epochs": len(curve),
            "final-accuracy": final, "best-accuracy": best if best is not None else final,
            "best-round": best_at, "best-epoch": best_at, "wall-seconds": 3725.4}))
    return cell


@pytest.fixture
def grid_dir(tmp_path):
    """Two settings; FedRep base/+FedSPC with two seeds in S1; gaps of every kind."""
    grid = tmp_path / "grid"
    grid.mkdir()
    cells = [
        write_run(grid, "fedavg-a0.1-S1", setting="S1", method="fedavg", final=0.45,
                  curve=(0.3, 0.45)),
        write_run(grid, "fedrep-a0.1-s0-S1", setting="S1", final=0.50, best=0.53,
                  curve=(0.53, 0.50)),
        write_run(grid, "fedrep-a0.1-s1-S1", setting="S1", seed=1, final=0.52,
                  curve=(0.4, 0.52)),
        write_run(grid, "fedrep+fedspc-a0.1-s0-S1", setting="S1", fedspc=True, final=0.55,
                  curve=(0.5, 0.55)),
        write_run(grid, "fedrep+fedspc-a0.1-s1-S1", setting="S1", fedspc=True, seed=1,
                  final=0.56, curve=(0.5, 0.56)),
        write_run(grid, "fedrep-a1-s0-S1", setting="S1", alpha=1.0, final=0.30,
                  curve=(0.2, 0.3)),
        write_run(grid, "fedrep+fedspc-a1-s0-S1", setting="S1", fedspc=True, alpha=1.0,
                  state="missing"),
        write_run(grid, "fedrep-a0.1-s0-S2", setting="S2", final=0.40, curve=(0.1, 0.4)),
        write_run(grid, "fedrep+fedspc-a0.1-s0-S2", setting="S2", fedspc=True,
                  curve=(0.2,), state="partial"),
        write_run(grid, "centralized-S1", setting="S1", method="centralized",
                  kind="centralized", final=0.70, best=0.71, curve=(0.6, 0.71, 0.70)),
    ]
    (grid / layout.GRID_JSON).write_text(json.dumps({"name": "grid", "cells": cells}))
    (grid / layout.FAILURES_JSON).write_text(json.dumps(
        {"fedrep+fedspc-a1-s0-S1": {"error": "boom", "log": "x.log"}}))
    return grid


def test_records_follow_the_grid_with_status(grid_dir):
    records = {r.name: r for r in load_records(grid_dir)}
    assert len(records) == 10
    assert records["fedrep-a0.1-s1-S1"].status == "complete"
    assert records["fedrep-a0.1-s1-S1"].final_accuracy == 0.52
    assert records["fedrep+fedspc-a1-s0-S1"].status == "failed"
    partial = records["fedrep+fedspc-a0.1-s0-S2"]
    assert (partial.status, partial.rounds, partial.final_accuracy) == ("partial", 1, 0.2)
    central = records["centralized-S1"]
    assert (central.kind, central.method, central.alpha, central.rounds) == (
        "centralized", "centralized", None, 3)
    assert central.curve == ((1, 0.6), (2, 0.71), (3, 0.70))


def test_table3_mean_std_delta_and_missing_cells(grid_dir):
    table = reports.table3(load_records(grid_dir))
    assert reports.to_markdown(table) == (
        "| Method | α | S1 Base | S1 +FedSPC | S1 Δ | S2 Base | S2 +FedSPC | S2 Δ |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n"
        "| FedRep | 0.1 | 51.00 ± 1.41 | 55.50 ± 0.71 | +4.50 | 40.00 | — | — |\n"
        "| FedRep | 1.0 | 30.00 | — | — | — | — | — |\n"
        "\n"
        "Centralized (S1): 70.00%\n")
    assert reports.to_csv(table) == (
        "method,alpha,setting,base,base_std,base_n,fedspc,fedspc_std,fedspc_n,delta\n"
        "FedRep,0.1,S1,51.0,1.4142,2,55.5,0.7071,2,4.5\n"
        "FedRep,0.1,S2,40.0,,1,,,0,\n"
        "FedRep,1.0,S1,30.0,,1,,,0,\n"
        "FedRep,1.0,S2,,,0,,,0,\n")


def test_table1_rows_method_by_alpha_in_the_papers_order(grid_dir):
    records = load_records(grid_dir)
    assert reports.to_markdown(reports.table1(records)) == (
        "| Method | α | S1 | S2 |\n"
        "| --- | --- | ---: | ---: |\n"
        "| FedAvg | 0.1 | 45.00 | — |\n"
        "| FedRep | 0.1 | 51.00 ± 1.41 | 40.00 |\n"
        "| FedRep | 1.0 | 30.00 | — |\n"
        "| FedRep+FedSPC | 0.1 | 55.50 ± 0.71 | — |\n"
        "| FedRep+FedSPC | 1.0 | — | — |\n"
        "\n"
        "Centralized (S1): 70.00%\n")
    csv_lines = reports.to_csv(reports.table1(records)).splitlines()
    assert csv_lines[0] == "method,fedspc,alpha,setting,accuracy,std,n"
    assert "FedRep,false,0.1,S1,51.0,1.4142,2" in csv_lines
    assert "FedRep,true,1.0,S2,,,0" in csv_lines
    best = reports.to_markdown(reports.table1(records, metric="best")).splitlines()
    assert best[3] == "| FedRep | 0.1 | 52.50 ± 0.71 | 40.00 |"  # best of 53 and 52
    assert best[-1] == "Centralized (S1): 71.00%"


def test_runs_table(grid_dir):
    table = reports.runs_table(load_records(grid_dir))
    markdown = reports.to_markdown(table).splitlines()
    assert markdown[0] == ("| Run | Status | Rounds | Final (%) | Best (%) | Best round "
                           "| Wall time | Code |")
    assert ("| fedrep-a0.1-s0-S1 | complete | 2 | 50.00 | 53.00 | 1 | 1:02:05 | unrecorded |"
            in markdown)
    assert "| fedrep+fedspc-a1-s0-S1 | failed | — | — | — | — | — | — |" in markdown
    assert ("| fedrep+fedspc-a0.1-s0-S2 | partial | 1 | 20.00 | 20.00 | 1 | 0:00:10 "
            "| unrecorded |") in markdown
    csv_lines = reports.to_csv(table).splitlines()
    assert csv_lines[0] == "run,kind,status,rounds,final,best,best_round,wall_seconds,code"
    assert "centralized-S1,centralized,complete,3,70.0,71.0,2,3725.4,unrecorded" in csv_lines


def test_a_run_made_under_other_settings_than_its_cell_is_stale_not_complete(tmp_path):
    # The grid now asks 20 rounds; Base seed 1 is a finished 10-round run (left from
    # a shorter horizon), and fedrep-s2's folder holds a seed-0 run (made with --set
    # seed=0). +FedSPC is +1 point on each seed.
    grid = tmp_path / "grid"
    cells = []
    for fedspc in (False, True):
        for seed, rounds in ((0, 20), (1, 10 if not fedspc else 20)):
            name = f"fedrep{'+fedspc' if fedspc else ''}-s{seed}"
            curve = tuple(0.30 + 0.01 * fedspc + 0.01 * i for i in range(rounds))
            cells.append(write_run(grid, name, setting="S", fedspc=fedspc, seed=seed,
                                   final=curve[-1], curve=curve))
            cells[-1]["run-config"]["num-rounds"] = 20
    moved = write_run(grid, "fedrep-s2", setting="S", seed=0, final=0.1, curve=(0.1,) * 20)
    moved["run-config"]["seed"] = 2
    cells.append(moved)
    (grid / layout.GRID_JSON).write_text(json.dumps({"name": "grid", "cells": cells}))
    records = {r.name: r for r in load_records(grid)}
    stale, moved = records["fedrep-s1"], records["fedrep-s2"]
    assert (stale.status, stale.changes, stale.complete, stale.rounds) == (
        "stale", ("num-rounds",), False, 10)
    # The row keys are the run's own: a seed-0 run is not reported as seed 2.
    assert (moved.status, moved.changes, moved.seed) == ("stale", ("seed",), 0)
    assert [r.status for r in records.values()].count("complete") == 3
    # Δ is +1 on seed 0, the only seed both sides ran at 20 rounds.
    assert reports.to_markdown(reports.table3(list(records.values()))).splitlines()[2] == (
        "| FedRep | 0.1 | 49.00 | 50.00 ± 0.00 | +1.00 |")
    runs = reports.runs_table(list(records.values()))
    assert runs.rows[1][:3] == ["fedrep-s1", "stale", "10"]
    assert runs.notes == (
        ("Stale: finished under other settings than the grid's cell now (in parentheses), "
         "so no table counts them; delete a run's folder and run the grid again to rerun "
         "it: fedrep-s1 (num-rounds), fedrep-s2 (seed)."),)
    reports.write_report(list(records.values()), grid / "report")
    assert "3 of 5 cells complete (2 stale: see Runs)" in (
        grid / "report" / "report.md").read_text()


def test_a_finished_run_with_an_unreadable_summary_reads_the_copy_in_its_metrics(tmp_path):
    cells = [write_run(tmp_path, name, setting="S", seed=seed, final=0.5, curve=(0.4, 0.5))
             for seed, name in enumerate(("damaged", "gone", "running"))]
    for name in ("damaged", "gone"):
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        metrics = json.loads((tmp_path / name / "metrics.json").read_text())
        (tmp_path / name / "metrics.json").write_text(json.dumps({**metrics,
                                                                  "summary": summary}))
    (tmp_path / "damaged" / "summary.json").write_text('{"complete": tr')
    (tmp_path / "gone" / "summary.json").unlink()
    (tmp_path / "running" / "summary.json").unlink()  # no summary anywhere: partial
    (tmp_path / layout.GRID_JSON).write_text(json.dumps({"cells": cells}))
    records = load_records(tmp_path)
    assert [(r.name, r.status, r.final_accuracy, r.wall_seconds) for r in records] == [
        ("damaged", "complete", 0.5, 3725.4), ("gone", "complete", 0.5, 3725.4),
        ("running", "partial", 0.5, 20.0)]


def test_stat_and_delta_text():
    assert summarize([]).text() == "—"
    assert summarize([12.345]).text() == "12.35"
    assert summarize([1.0, 2.0, 3.0]).text() == "2.00 ± 1.00"
    assert delta_text(1.234) == "+1.23"
    assert delta_text(-0.34) == "-0.34"
    assert delta_text(None) == "—"


def test_records_without_grid_json_come_from_the_folders(tmp_path):
    write_run(tmp_path, "a", setting="ignored", final=0.5, curve=(0.5,))
    write_run(tmp_path, "b", setting="ignored", fedspc=True, final=0.6, curve=(0.6,))
    records = load_records(tmp_path)
    assert [(r.name, r.setting, r.fedspc) for r in records] == [
        ("a", "cifar100-cnn", False), ("b", "cifar100-cnn", True)]
    assert reports.to_markdown(reports.table3(records)).splitlines()[2] == (
        "| FedRep | 0.1 | 50.00 | 60.00 | +10.00 |")


def test_figures_and_report_files(grid_dir):
    labels = np.repeat(np.arange(5), 20)
    for name, alpha in (("fedrep-a0.1-s0-S1", 0.1), ("fedrep-a1-s0-S1", 1.0)):
        partition = dirichlet_partition(labels, labels, num_clients=4, alpha=alpha, seed=0,
                                        min_samples=1)
        save_partition(partition, grid_dir / name)
    records = load_records(grid_dir)
    out = grid_dir / "report"
    written = reports.write_report(records, out, title="grid")
    names = sorted(p.name for p in written)
    assert names == sorted([
        "table1.md", "table1.csv", "table3.md", "table3.csv", "best.md", "best.csv",
        "pairs.md", "pairs.csv", "centralized.md", "centralized.csv", "runs.md", "runs.csv",
        "curves-S1-a0.1.png", "curves-S1-a1.png", "curves-S2-a0.1.png",
        "delta-curves-S1-a0.1.png", "partitions-cifar100.png", "delta.png", "report.md"])
    for path in written:
        if path.suffix == ".png":
            assert path.read_bytes()[:8] == PNG
    report = (out / "report.md").read_text()
    assert report.startswith("# Results: grid\n")
    assert "| FedRep | 0.1 | 51.00 ± 1.41 | 55.50 ± 0.71 | +4.50 |" in report
    assert ("| FedRep | 0.1 | S1 | 2 | 51.00 | 55.50 | +4.50 | +4.00 | +4.50 | 2 / 0 | 2 "
            "| +5.00 / +4.00 | unrecorded |") in report
    assert "![delta](delta.png)" in report
    assert (out / "centralized.md").read_text().splitlines()[2] == "| S1 | 70.00 | 71.00 |"


def test_an_unreadable_partition_file_costs_a_panel_at_most_not_the_report(grid_dir,
                                                                          monkeypatch):
    # α = 0.1: seed 0's partition.json is cut short, seed 1's is whole: its panel is
    # drawn from seed 1. α = 1.0: its only run's file is cut short: no panel.
    labels = np.repeat(np.arange(5), 20)
    for name, alpha in (("fedrep-a0.1-s0-S1", 0.1), ("fedrep-a0.1-s1-S1", 0.1),
                        ("fedrep-a1-s0-S1", 1.0)):
        save_partition(dirichlet_partition(labels, labels, num_clients=4, alpha=alpha,
                                           seed=0, min_samples=1), grid_dir / name)
    whole = (grid_dir / "fedrep-a0.1-s1-S1" / "partition.json").read_text()
    for name in ("fedrep-a0.1-s0-S1", "fedrep-a1-s0-S1"):
        (grid_dir / name / "partition.json").write_text(whole[:40])
    drawn = []
    monkeypatch.setattr(plots, "plot_partitions",
                        lambda panels, path, title: drawn.append(panels) or path)
    written = reports.write_report(load_records(grid_dir), grid_dir / "report")
    assert [[title for title, _ in panels] for panels in drawn] == [["α = 0.1"]]
    assert grid_dir / "report" / "partitions-cifar100.png" in written
    report = (grid_dir / "report" / "report.md").read_text()
    assert "Left out of the partition heatmaps, their partition.json unreadable: " in report
    assert "fedrep-a0.1-s0-S1 (Cannot read partition file " in report
    assert "fedrep-a1-s0-S1 (Cannot read partition file " in report


def test_settings_named_in_other_scripts_get_figures_of_their_own(tmp_path):
    assert [layout.slug(t) for t in ("ρ = 0.5", "σ = 0.5", "α-sweep", "E = 1", "a/b c")] == [
        "ρ_=_0.5", "σ_=_0.5", "α-sweep", "E_=_1", "a_b_c"]  # ASCII names as before
    cells = [write_run(tmp_path, f"fedrep{'+fedspc' if spc else ''}-{name}", setting=label,
                       fedspc=spc, final=0.5, curve=(0.4, 0.5))
             for name, label in (("rho", "ρ = 0.5"), ("sigma", "σ = 0.5"))
             for spc in (False, True)]
    (tmp_path / layout.GRID_JSON).write_text(json.dumps({"cells": cells}))
    written = reports.write_report(load_records(tmp_path), tmp_path / "report")
    curves = sorted(p.name for p in written if p.name.startswith("curves-"))
    assert curves == ["curves-ρ_=_0.5-a0.1.png", "curves-σ_=_0.5-a0.1.png"]


def test_pairs_compare_seed_mean_curves_on_complete_pairs_only(grid_dir):
    # S1, α = 0.1: Base seeds (53, 50) and (40, 52) average to (46.5, 51.0), +FedSPC
    # (50, 55) and (50, 56) to (50.0, 55.5). α = 1.0 has no +FedSPC run and S2 only a
    # partial one, so neither gets a row.
    table = reports.pairs_table(load_records(grid_dir))
    assert table.csv_rows == [["FedRep", "0.1", "S1", 2, 2, 51.0, 55.5, 4.5, 4.0, 4.5, 2, 0,
                               "0 1", "5.0 4.0", "unrecorded"]]
    assert table.notes == ()


def test_pairs_compare_on_the_rounds_every_paired_run_recorded(tmp_path):
    # +FedSPC is 2 points ahead at every round of both seeds; seed 1's Base did not
    # evaluate round 3 (a failed round). Round 3's means would be of different seeds
    # (Base: seed 0 alone, 58; +FedSPC: both, 50) and give -8: round 2 is the last.
    grid = tmp_path / "grid"
    cells = [write_run(grid, f"{name}-s{seed}", setting="S", fedspc="+" in name, seed=seed,
                       final=curve[-1], curve=curve,
                       series={"accuracy-before-aggregation": tuple(a + 0.01 for a in curve),
                               "drift-dispersion": (1.0,) * 3})
             for name, seed, curve in (("fedrep", 0, (0.58,) * 3), ("fedrep+fedspc", 0, (0.6,) * 3),
                                       ("fedrep", 1, (0.38,) * 3), ("fedrep+fedspc", 1, (0.4,) * 3))]
    metrics = grid / "fedrep-s1" / "metrics.json"
    rows = json.loads(metrics.read_text())
    rows["rounds"][2].pop("accuracy")  # measured before aggregation, not after
    metrics.write_text(json.dumps(rows))
    (grid / layout.GRID_JSON).write_text(json.dumps({"name": "grid", "cells": cells}))
    records = load_records(grid)
    row = reports.pairs_table(records).csv_rows[0]
    assert row[3] == 2 and row[5:10] == [48.0, 50.0, 2.0, 2.0, 2.0]
    assert row[10:12] == [2, 0]  # rounds ahead / behind
    # The averaging gap is each run's own (+1 point at every round), then their mean.
    gaps = [r[-2] for r in reports.drift_table(records).csv_rows]
    assert len(gaps) == 2 and gaps == pytest.approx([1.0, 1.0])  # rounds 2-3, each side


def test_the_accuracy_figure_leaves_out_failed_and_partial_runs(tmp_path, monkeypatch):
    grid = tmp_path / "grid"
    cells = [write_run(grid, "fedrep-s0", setting="S", final=0.5, curve=(0.5, 0.5)),
             write_run(grid, "fedrep-s1", setting="S", seed=1, final=0.52, curve=(0.52, 0.52)),
             write_run(grid, "fedrep-s2", setting="S", seed=2, curve=(0.01,), state="partial")]
    (grid / layout.GRID_JSON).write_text(json.dumps({"name": "grid", "cells": cells}))
    drawn = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: drawn.append(fig) or path)
    plots.plot_curves(load_records(grid), "S", 0.1, "curves.png")
    (base,) = drawn[0].axes[0].get_lines()
    assert list(base.get_ydata()) == pytest.approx([51.0, 51.0])


@pytest.mark.parametrize(("segments", "code", "notes"), [
    # Both runs of each seed by one code version (seeds may differ from each other).
    ({"b0": [(1, "a" * 64)], "s0": [(1, "a" * 64)], "b1": [(1, "c" * 64)],
      "s1": [(1, "c" * 64)]}, "same", ()),
    # Seed 1's +FedSPC run was made by other code than its Base.
    ({"b0": [(1, "a" * 64)], "s0": [(1, "a" * 64)], "b1": [(1, "a" * 64)],
      "s1": [(1, "b" * 64)]}, "mixed",
     (("Mixed code: FedRep, α = 0.1, S, seed 1: b1 (source aaaaaaaa) vs "
       "s1 (source bbbbbbbb)."),)),
    # Seed 0's Base went on under other code after a resume.
    ({"b0": [(1, "a" * 64), (3, "b" * 64)], "s0": [(1, "a" * 64)], "b1": [(1, "a" * 64)],
      "s1": [(1, "a" * 64)]}, "mixed",
     ("Mixed code: b0 went on under other code from round 3.",
      "Mixed code: FedRep, α = 0.1, S, seed 0: its runs were made by 2 code versions.")),
    # A resume under the same code is one version; one run without a record: unknown.
    ({"b0": [(1, "a" * 64), (3, "a" * 64)], "s0": [(1, "a" * 64)], "b1": None,
      "s1": [(1, "a" * 64)]}, "unrecorded", ()),
])
def test_pairs_mark_runs_made_by_different_code(tmp_path, segments, code, notes):
    cells = [write_run(tmp_path, name, setting="S", fedspc=name[0] == "s",
                       seed=int(name[1]), final=0.5, curve=(0.4, 0.5), segments=segments[name])
             for name in ("b0", "s0", "b1", "s1")]
    records = load_records(tmp_path, cells)
    table = reports.pairs_table(records)
    assert table.rows[0][-1] == code and table.notes == notes
    runs = {row[0]: row[-1] for row in reports.runs_table(records).rows}
    if code == "mixed" and segments["b0"][1:]:
        assert runs["b0"] == ("from round 1: source aaaaaaaa; from round 3: source "
                              "bbbbbbbb (mixed)")
    else:
        assert runs["b0"] == "source aaaaaaaa"
    assert runs["b1"] == ("unrecorded" if segments["b1"] is None else
                          f"source {segments['b1'][0][1][:8]}")


def test_pairs_window_ties_and_rounds_behind(tmp_path):
    cells = [write_run(tmp_path, "base", setting="S", final=0.2, curve=(0.1, 0.3, 0.2)),
             write_run(tmp_path, "spc", setting="S", fedspc=True, final=0.4,
                       curve=(0.1, 0.2, 0.4))]
    table = reports.pairs_table(load_records(tmp_path, cells), window=2)
    # Round 1 ties, round 2 behind, round 3 ahead; last 2 rounds: 30 vs 25; best 40 vs 30.
    assert table.rows == [["FedRep", "0.1", "S", "3", "20.00", "40.00", "+20.00", "+5.00",
                           "+10.00", "1 / 1", "1", "+20.00", "unrecorded"]]
    assert table.columns[7] == "Δ last 2"
    with pytest.raises(ValueError, match="window"):
        reports.pairs_table([], window=0)


def test_pairs_and_deltas_use_only_the_seeds_both_sides_ran(tmp_path):
    # Base has seeds 0, 1 and 2, +FedSPC only 0 and 1 (a study in progress). Seed 2's
    # Base run (80 %) must not move Δ: paired, seed 0 gives +10 and seed 1 -4.
    cells = [
        write_run(tmp_path, "b0", setting="S", final=0.40, curve=(0.3, 0.40)),
        write_run(tmp_path, "b1", setting="S", seed=1, final=0.50, curve=(0.4, 0.50)),
        write_run(tmp_path, "b2", setting="S", seed=2, final=0.80, curve=(0.7, 0.80)),
        write_run(tmp_path, "s0", setting="S", fedspc=True, final=0.50, curve=(0.2, 0.50)),
        write_run(tmp_path, "s1", setting="S", fedspc=True, seed=1, final=0.46,
                  curve=(0.5, 0.46)),
        # A base method with no +FedSPC side at all is not "left out".
        write_run(tmp_path, "fedavg", setting="S", method="fedavg", final=0.3,
                  curve=(0.2, 0.3)),
    ]
    records = load_records(tmp_path, cells)
    table = reports.pairs_table(records)
    # Seed-mean curves: Base (35, 45), +FedSPC (35, 48): round 1 level, round 2 ahead;
    # both rounds' means 40 against 41.5.
    assert table.rows == [["FedRep", "0.1", "S", "2", "45.00", "48.00", "+3.00", "+1.50",
                           "+3.00", "1 / 0", "2", "+10.00 / -4.00", "unrecorded"]]
    assert table.notes == ("Left out, no run of the other side with the same seed: b2.",)
    assert paired_delta(records, method="fedrep", alpha=0.1, setting="S") == pytest.approx(3.0)
    assert paired_delta(records, method="fedavg", alpha=0.1, setting="S") is None
    # Table 3 shows each side's mean over its own seeds and the paired Δ.
    assert reports.to_markdown(reports.table3(records)).splitlines()[2] == (
        "| FedRep | 0.1 | 56.67 ± 20.82 | 48.00 ± 2.83 | +3.00 |")
    assert reports.table3(records).notes == (
        reports.UNEVEN_NOTE + "FedRep α 0.1 S (Base seeds 0, 1, 2, +FedSPC 0, 1).",)


def _with_clients(run_dir: Path, sizes: list[int], accuracy: dict[str, float]) -> None:
    """Give a written run a partition of ``sizes`` training images and the final
    round's per-client accuracies."""
    (run_dir / "partition.json").write_text(json.dumps({
        "num_clients": len(sizes), "num_classes": 1,
        "train_counts": [[n] for n in sizes], "test_counts": [[1] for _ in sizes]}))
    metrics = json.loads((run_dir / "metrics.json").read_text())
    metrics["rounds"][-1]["client-accuracy"] = accuracy
    (run_dir / "metrics.json").write_text(json.dumps(metrics))


def test_clients_table_compares_each_client_of_each_paired_seed(tmp_path):
    runs = [  # name, seed, fedspc, sizes, per-client accuracy
        ("b0", 0, False, [30, 10, 20], {"0": 0.50, "1": 0.40, "2": 0.60}),
        ("s0", 0, True, [30, 10, 20], {"0": 0.55, "1": 0.30, "2": 0.60}),
        ("b1", 1, False, [5, 50], {"0": 0.20, "1": 0.30}),
        ("s1", 1, True, [5, 50], {"0": 0.32, "1": 0.25}),
        # Seed 2's two runs have different partitions: not comparable client by client.
        ("b2", 2, False, [7], {"0": 0.1}),
        ("s2", 2, True, [8], {"0": 0.9}),
    ]
    cells = []
    for name, seed, fedspc, sizes, accuracy in runs:
        cells.append(write_run(tmp_path, name, setting="S", fedspc=fedspc, seed=seed,
                               final=0.5, curve=(0.5,)))
        _with_clients(tmp_path / name, sizes, accuracy)
    # Seed 3 recorded no per-client accuracy (an older run): paired, but not counted.
    cells += [write_run(tmp_path, "b3", setting="S", seed=3, final=0.5, curve=(0.5,)),
              write_run(tmp_path, "s3", setting="S", fedspc=True, seed=3, final=0.5,
                        curve=(0.5,))]
    table = reports.clients_table(load_records(tmp_path, cells))
    # Δ_k: seed 0 +5, -10, 0 (sizes 30, 10, 20); seed 1 +12, -5 (sizes 5, 50).
    # Smaller half: client 1 of seed 0 (-10) and client 0 of seed 1 (+12) -> +1;
    # larger half: client 0 of seed 0 (+5), client 1 of seed 1 (-5) -> 0.
    assert table.rows == [["FedRep", "0.1", "S", "2", "5", "2 / 2", "+0.40", "+0.00",
                           "-10.00", "+12.00", "+1.00", "+0.00"]]
    assert table.notes == ("Left out, the two runs' partitions differ: b2 / s2.",)
    assert table.csv_rows[0][3:7] == [2, 5, 2, 2]


def test_drift_table_averages_seed_means_over_the_two_halves(tmp_path):
    cells = [
        write_run(tmp_path, "base", setting="S", final=0.4, curve=(0.1, 0.2, 0.3, 0.4),
                  series={"drift-dispersion": (9.0, 2.0, 4.0, 6.0),
                          "update-cosine": (0.9, 0.5, 0.4, 0.2),
                          "train-loss": (3.0, 2.5, 2.0, 1.5),
                          "accuracy-before-aggregation": (0.15, 0.25, 0.32, 0.43)}),
        # Two +FedSPC seeds: the table averages their per-round means; seed 1 has
        # no ‖ū‖ in round 3, so round 3's mean is seed 0's alone.
        write_run(tmp_path, "spc-s0", setting="S", fedspc=True, final=0.5,
                  curve=(0.1, 0.2, 0.4, 0.5),
                  series={"drift-dispersion": (5.0, 1.0, 2.0, 3.0),
                          "global-reference-norm": (0.0, 0.4, 0.3, 0.2)}),
        write_run(tmp_path, "spc-s1", setting="S", fedspc=True, seed=1, final=0.3,
                  curve=(0.1, 0.2, 0.2, 0.3),
                  series={"drift-dispersion": (7.0, 3.0, 4.0, 5.0),
                          "global-reference-norm": (0.0, 0.2, None, 0.4)}),
        # No drift columns recorded (a run older than the diagnostics): no rows.
        write_run(tmp_path, "fedavg", setting="S", method="fedavg", final=0.2,
                  curve=(0.1, 0.2, 0.2, 0.2), series={"train-loss": (2.0, 2.0, 2.0, 2.0)}),
    ]
    table = reports.drift_table(load_records(tmp_path, cells))
    # Windows of 4 rounds: round 2, then rounds 3–4.
    assert [row[:4] for row in table.rows] == [
        ["FedRep", "0.1", "S", "2"], ["FedRep", "0.1", "S", "3–4"],
        ["FedRep+FedSPC", "0.1", "S", "2"], ["FedRep+FedSPC", "0.1", "S", "3–4"]]
    by_window = {(r[0], r[3]): dict(zip(table.columns, r)) for r in table.rows}
    base = by_window["FedRep", "3–4"]
    assert (base["Dispersion"], base["Cosine"], base["Train loss"]) == ("5.00", "0.30", "1.750")
    assert base["‖ū‖"] == base["‖mean Δ‖"] == "—"
    # Before − after aggregation: rounds 3 and 4 give 2 and 3 points.
    assert base["Averaging gap"] == "+2.50" and by_window["FedRep", "2"]["Averaging gap"] == "+5.00"
    spc = by_window["FedRep+FedSPC", "3–4"]
    # Dispersion: round means 3.0 and 4.0; ‖ū‖: 0.3 (seed 0 only) and 0.3.
    assert (spc["Dispersion"], spc["‖ū‖"], spc["Seeds"]) == ("3.50", "0.300", "2")
    assert by_window["FedRep+FedSPC", "2"]["‖ū‖"] == "0.300"
    assert spc["Averaging gap"] == "—"
    assert table.csv_rows[1][:6] == ["FedRep", "false", "0.1", "S", 3, 4]
    assert reports.halves(20) == [(2, 10), (11, 20)]
    assert reports.halves(50) == [(2, 25), (26, 50)]
    assert reports.halves(3) == [(2, 3)] and reports.halves(1) == [(1, 1)]
    written = {p.name for p in reports.write_report(load_records(tmp_path, cells),
                                                    tmp_path / "r")}
    assert {"drift.md", "drift.csv"} <= written
    no_drift = [write_run(tmp_path / "g2", "fedavg", setting="S", method="fedavg",
                          final=0.2, curve=(0.2,), series={"train-loss": (2.0,)})]
    written = {p.name for p in reports.write_report(load_records(tmp_path / "g2", no_drift),
                                                    tmp_path / "r2")}
    assert "drift.md" not in written and not any(n.startswith("drift-") for n in written)


def test_no_fedspc_cells_means_no_table3_and_no_delta_chart(tmp_path):
    cells = [write_run(tmp_path, "fedavg", setting="S", method="fedavg", final=0.4,
                       curve=(0.4,))]
    written = reports.write_report(load_records(tmp_path, cells), tmp_path / "r")
    names = {p.name for p in written}
    assert "table1.md" in names and "delta.png" not in names
    assert "table3.md" not in names and "pairs.md" not in names


def test_delta_chart_draws_only_the_alphas_that_have_a_delta(grid_dir, monkeypatch):
    drawn = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: drawn.append(fig) or path)
    assert plots.plot_deltas(load_records(grid_dir), "delta.png") == Path("delta.png")
    s1, s2 = drawn[0].axes
    # S1: a Δ at α = 0.1 only (+FedSPC at α = 1 is missing): one bar, one legend entry,
    # labelled with its value; S2 has no Δ at all, so no bars and no legend.
    assert [t.get_text() for t in s1.get_legend().get_texts()] == ["α = 0.1"]
    assert [round(p.get_height(), 2) for p in s1.patches] == [4.5]
    # Its two seeds' Δ (+5, +4) as dots, their sample SD as the error bar and label.
    dots = np.concatenate([c.get_offsets() for c in s1.collections
                           if isinstance(c, PathCollection)])
    assert sorted(np.round(dots[:, 1], 2)) == [4.0, 5.0]
    assert [t.get_text() for t in s1.texts] == ["+4.50 ± 0.71 (2 seeds)"]
    caps = [line for line in s1.lines if len(line.get_ydata()) == 1]
    assert sorted(round(float(line.get_ydata()[0]), 2) for line in caps) == [3.79, 5.21]
    assert len(s2.patches) == 0 and s2.get_legend() is None


def test_delta_curves_draw_each_paired_seed_and_their_mean(grid_dir, monkeypatch):
    records = load_records(grid_dir)
    # S1, α = 0.1: seed 0 Base (53, 50) against +FedSPC (50, 55), seed 1 (40, 52)
    # against (50, 56); α = 1 has no +FedSPC run, S2 only a partial one.
    curves = seed_delta_curves(records, method="fedrep", alpha=0.1, setting="S1")
    assert {s: {r: round(d, 6) for r, d in c.items()} for s, c in curves.items()} == {
        0: {1: -3.0, 2: 5.0}, 1: {1: 10.0, 2: 4.0}}
    assert seed_delta_curves(records, method="fedrep", alpha=1.0, setting="S1") == {}
    drawn = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: drawn.append(fig) or path)
    assert plots.plot_delta_curves(records, "S1", 0.1, "d.png") == Path("d.png")
    assert plots.plot_delta_curves(records, "S2", 0.1, "d.png") is None
    (ax,) = [a for a in drawn[0].axes if a.get_visible()]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["seed 1"].get_ydata()) == pytest.approx([10.0, 4.0])
    assert list(lines["mean of 2 seeds"].get_ydata()) == pytest.approx([3.5, 4.5])
    band = ax.collections[0].get_paths()[0].vertices[:, 1]  # the ± SD band's outline
    assert max(band) == pytest.approx(3.5 + 13 / 2 ** 0.5)
    assert min(band) == pytest.approx(3.5 - 13 / 2 ** 0.5)


def test_the_curves_add_the_global_model_where_a_run_recorded_it(tmp_path, monkeypatch):
    grid = tmp_path / "grid"
    cells = [
        write_run(grid, "ditto", setting="S", method="ditto", final=0.5, curve=(0.4, 0.5),
                  series={"global-accuracy": (0.2, 0.3)}),
        write_run(grid, "ditto+fedspc", setting="S", method="ditto", fedspc=True, final=0.45,
                  curve=(0.4, 0.45), series={"global-accuracy": (0.25, None)}),
        write_run(grid, "fedrep", setting="S", final=0.5, curve=(0.4, 0.5)),
    ]
    (grid / layout.GRID_JSON).write_text(json.dumps({"name": "grid", "cells": cells}))
    drawn = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: drawn.append(fig) or path)
    plots.plot_curves(load_records(grid), "S", 0.1, "curves.png")
    ditto, fedrep = drawn[0].axes
    lines = {line.get_label(): line for line in ditto.get_lines()}
    assert set(lines) == {"Base", "+FedSPC", "Base, global model", "+FedSPC, global model"}
    assert list(lines["Base, global model"].get_ydata()) == pytest.approx([20.0, 30.0])
    assert list(lines["+FedSPC, global model"].get_xdata()) == [1]  # round 2 not recorded
    assert lines["Base, global model"].get_linestyle() == ":"
    assert [line.get_label() for line in fedrep.get_lines()] == ["Base"]


def test_a_report_of_two_grids_puts_standard_fl_beside_pfl(tmp_path, capsys):
    fl, pfl = tmp_path / "fl", tmp_path / "pfl"
    write_run(fl, "fedavg", setting="ignored", method="fedavg", final=0.2, curve=(0.2,))
    write_run(pfl, "fedrep", setting="ignored", final=0.5, curve=(0.5,))
    write_run(pfl, "fedrep+fedspc", setting="ignored", fedspc=True, final=0.45,
              curve=(0.45,))
    with pytest.raises(ConfigError, match="needs --out"):
        cli.report([str(fl), str(pfl)], None, None)
    out = cli.report([str(fl), str(pfl)], str(tmp_path / "both"), None)
    table1 = (out / "table1.md").read_text().splitlines()
    assert table1[2:] == ["| FedAvg | 0.1 | 20.00 |", "| FedRep | 0.1 | 50.00 |",
                          "| FedRep+FedSPC | 0.1 | 45.00 |"]
    assert (out / "report.md").read_text().startswith("# Results: fl + pfl\n")
    assert "Report of 3 cells" in capsys.readouterr().out


def test_labels_keep_grids_of_one_setting_apart(tmp_path):
    # Two grids of the same dataset and model (a regime study: E = 1 and E = 5).
    e1, e5 = tmp_path / "e1", tmp_path / "e5"
    for folder, base, spc in ((e1, 0.4, 0.38), (e5, 0.5, 0.46)):
        write_run(folder, "fedrep", setting="ignored", final=base, curve=(0.3, base))
        write_run(folder, "fedrep+fedspc", setting="ignored", fedspc=True, final=spc,
                  curve=(0.3, spc))
    merged = cli.report([str(e1), str(e5)], str(tmp_path / "merged"), None)
    # Without labels the two grids' runs are one cell with two "seeds".
    assert "| FedRep | 0.1 | 45.00 ± 7.07 | 42.00 ± 5.66 | -3.00 |" in (
        merged / "table3.md").read_text()
    out = cli.report([str(e1), str(e5)], str(tmp_path / "apart"), None,
                     labels=["E = 1", "E = 5"])
    pairs = (out / "pairs.md").read_text().splitlines()[2:]
    assert [row.split(" | ")[2:7] for row in pairs] == [
        ["E = 1", "2", "40.00", "38.00", "-2.00"], ["E = 5", "2", "50.00", "46.00", "-4.00"]]
    with pytest.raises(ConfigError, match="1 labels for 2 grids"):
        cli.report([str(e1), str(e5)], str(tmp_path / "x"), None, labels=["E = 1"])
    # One label pools grids as seeds of one setting, but not the same seed twice.
    with pytest.raises(ConfigError, match="e1 and e5 share the label 'a' and both hold "
                                          "FedRep alpha=0.1 seed=0"):
        cli.report([str(e1), str(e5)], str(tmp_path / "x"), None, labels=["a", "a"])
    assert not (tmp_path / "x").exists()


def test_one_label_pools_a_seed_grid_with_the_grid_it_repeats(tmp_path):
    first, more = tmp_path / "first", tmp_path / "more"
    write_run(first, "fedrep", setting="ignored", final=0.4, curve=(0.4,))
    write_run(first, "fedrep+fedspc", setting="ignored", fedspc=True, final=0.38,
              curve=(0.38,))
    write_run(first, "fedavg", setting="ignored", method="fedavg", final=0.3, curve=(0.3,))
    write_run(more, "fedrep-s1", setting="ignored", seed=1, final=0.5, curve=(0.5,))
    write_run(more, "fedrep+fedspc-s1", setting="ignored", fedspc=True, seed=1, final=0.44,
              curve=(0.44,))
    out = cli.report([str(first), str(more)], str(tmp_path / "pooled"), None,
                     labels=["E1", "E1"])
    pairs = (out / "pairs.md").read_text().splitlines()[2]
    assert pairs.split(" | ")[2:7] == ["E1", "1", "45.00", "41.00", "-4.00"]
    assert pairs.endswith("| 2 | -2.00 / -6.00 | unrecorded |")


def test_the_drift_figure_leaves_out_the_panels_a_method_did_not_record(tmp_path, monkeypatch):
    grid = tmp_path / "grid"
    full = {"drift-dispersion": (3.0, 2.0), "update-cosine": (0.4, 0.5),
            "update-norm": (0.2, 0.1), "global-reference-norm": (0.1, 0.05)}
    cells = [
        write_run(grid, "lgfedavg", setting="S", method="lgfedavg", curve=(0.4, 0.5),
                  series={k: v for k, v in full.items() if k != "global-reference-norm"}),
        write_run(grid, "lgfedavg+fedspc", setting="S", method="lgfedavg", fedspc=True,
                  curve=(0.4, 0.5), series=full),
        # A base without the diagnostics and a +FedSPC run that recorded only ‖ū‖.
        write_run(grid, "fedrep", setting="S", curve=(0.4, 0.5)),
        write_run(grid, "fedrep+fedspc", setting="S", fedspc=True, curve=(0.4, 0.5),
                  series={"global-reference-norm": (0.1, 0.05)}),
    ]
    (grid / layout.GRID_JSON).write_text(json.dumps({"name": "grid", "cells": cells}))
    drawn = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: drawn.append(fig) or path)
    plots.plot_drift(load_records(grid), "S", 0.1, "drift.png")
    columns = {ax.get_title(): ax for ax in drawn[0].axes if ax.get_title()}
    visible = [ax for ax in drawn[0].axes if ax.get_visible()]
    assert all(ax.lines for ax in visible)  # no empty panel is drawn
    assert len(visible) == 4 + 1  # LG-FedAvg's four panels, FedRep's ‖ū‖ only
    assert set(columns) == {"FedRep", "LG-FedAvg"}
    # Each quantity is named once, on the first panel that draws it.
    labels = [ax.get_ylabel() for ax in visible if ax.get_ylabel()]
    assert sorted(labels) == sorted(label for _, label, _ in plots.DRIFT_PANELS)


def test_a_class_count_run_is_a_setting_of_its_own_and_its_partition_plot_says_so(tmp_path):
    from fedspc_app.experiments.cli import split_label
    from fedspc_app.experiments.records import read_record

    folder = tmp_path / "run"
    folder.mkdir()
    rc = {"dataset": "cifar100", "model": "cnn", "method": "local", "partition": "classes",
          "classes-per-client": 5, "alpha": 0.1}
    (folder / "config.json").write_text(json.dumps({"run-config": rc}))
    assert read_record(folder).setting == "cifar100-cnn 5 classes/client"
    rc["partition"] = "dirichlet"
    (folder / "config.json").write_text(json.dumps({"run-config": rc}))
    assert read_record(folder).setting == "cifar100-cnn"
    assert split_label({"alpha": 0.1}) == "alpha = 0.1"
    assert split_label({"classes_per_client": 5}) == "5 classes per client"


def test_a_class_count_split_has_rows_of_its_own_not_the_alpha_it_does_not_use(
        tmp_path, monkeypatch):
    # Both runs carry alpha = 0.1; only the Dirichlet one is split by it.
    grid = tmp_path / "grid"
    grid.mkdir()
    classes = {"partition": "classes", "classes-per-client": 5}
    cells = [write_run(grid, "fedrep-a0.1", setting="a0.1", final=0.40, curve=(0.3, 0.4)),
             write_run(grid, "fedrep-c5", setting="c5", final=0.56, curve=(0.5, 0.56),
                       extra=classes),
             write_run(grid, "fedrep+fedspc-c5", setting="c5", fedspc=True, final=0.52,
                       curve=(0.5, 0.52), extra=classes)]
    (grid / layout.GRID_JSON).write_text(json.dumps({"name": "grid", "cells": cells}))
    labels = np.repeat(np.arange(5), 20)
    for name in ("fedrep-a0.1", "fedrep-c5"):
        save_partition(dirichlet_partition(labels, labels, num_clients=4, alpha=0.1, seed=0,
                                           min_samples=1), grid / name)
    records = load_records(grid)
    assert reports.to_markdown(reports.table1(records)).splitlines()[2:] == [
        "| FedRep | 0.1 | 40.00 | — |",
        "| FedRep | 5 classes/client | — | 56.00 |",
        "| FedRep+FedSPC | 5 classes/client | — | 52.00 |"]
    assert reports.to_markdown(reports.table3(records)).splitlines()[2:] == [
        "| FedRep | 0.1 | 40.00 | — | — | — | — | — |",
        "| FedRep | 5 classes/client | — | — | — | 56.00 | 52.00 | -4.00 |"]
    drawn = []
    monkeypatch.setattr(plots, "plot_partitions",
                        lambda panels, path, **_: drawn.append([t for t, _ in panels]) or path)
    written = reports.write_report(records, grid / "report", title="grid")
    assert drawn == [["α = 0.1", "5 classes/client"]]  # one panel each, not one for α 0.1
    assert {p.name for p in written} >= {"curves-a0.1-a0.1.png", "curves-c5-c5.png"}
