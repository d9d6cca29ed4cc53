"""The plan's time estimate (fedspc_app.experiments.estimate): which measured rounds
predict a pending cell, and the figures the plan prints, checked by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fedspc_app.experiments import cli, runner
from fedspc_app.experiments.estimate import estimate, machine_label, timed_runs
from fedspc_app.experiments.grid import expand_grid

HERE = {"cpu": "Test CPU", "cores": 2, "platform": "Linux"}
OTHER = {"cpu": "Other CPU", "cores": 8, "platform": "Linux"}


@pytest.fixture(autouse=True)
def this_machine(monkeypatch):
    monkeypatch.setattr(runner, "machine", lambda device="cpu": dict(HERE))


def grid_of(tmp_path: Path, rounds: int = 4):
    spec = {"base": {"num-rounds": rounds},
            "axes": {"method": ["fedrep"], "fedspc": [False, True], "seed": [0, 1, 2]}}
    return expand_grid(spec, name="g", base_dir=tmp_path, output_dir=tmp_path / "out")


def cell(grid, name):
    return next(c for c in grid.cells if c.name == name)


def record(run_dir: Path, run_config: dict, seconds: list[float], *,
           segments: list[tuple[int, dict | None]] | None = None, clients: int = 10,
           checkpoint: int | None = None) -> None:
    """What a run leaves behind: config.json (with its segments' machines) and
    metrics.json with one timed entry per round; a checkpoint when interrupted."""
    run_dir.mkdir(parents=True, exist_ok=True)
    segments = segments if segments is not None else [(1, HERE)]
    config = {"run-config": run_config, "num-clients": clients,
              "segments": [{"first-round": first, "machine": m} for first, m in segments]}
    (run_dir / "config.json").write_text(json.dumps(config))
    rounds = [{"round": i + 1, "round-seconds": s} for i, s in enumerate(seconds)]
    (run_dir / "metrics.json").write_text(json.dumps({"rounds": rounds}))
    if checkpoint is not None:
        (run_dir / "checkpoint.json").write_text(
            json.dumps({"round": checkpoint, "elapsed-seconds": sum(seconds)}))


def plan(grid, **kwargs) -> list[str]:
    lines: list[str] = []
    runner.print_plan(grid, grid.cells, echo=lines.append, **kwargs)
    return lines


def finished(grid, name: str, seconds: list[float], **kwargs) -> None:
    c = cell(grid, name)
    record(c.run_dir, c.run_config, seconds, **kwargs)
    (c.run_dir / "summary.json").write_text(json.dumps({"complete": True,
                                                        "rounds": len(seconds)}))


def test_pending_cells_are_timed_by_the_median_round_of_runs_like_them(tmp_path):
    grid = grid_of(tmp_path)
    finished(grid, "fedrep-s0", [10, 30, 20, 40])
    finished(grid, "fedrep-s1", [50, 12, 14, 16])
    lines = plan(grid)
    # fedrep-s2: median of the eight rounds 10 12 14 16 | 20 30 40 50 = 18 s, 4 rounds.
    at = lines.index(next(line for line in lines if " fedrep-s2 " in line))
    assert lines[at + 1] == ("          ≈ 0:01:12 for 4 rounds at 0:00:18 a round "
                             "(median of 8 rounds of 2 runs like it, this machine)")
    # The +FedSPC cells have no run of their own kind: FedRep's rounds, said so.
    at = lines.index(next(line for line in lines if " fedrep+fedspc-s0 " in line))
    assert lines[at + 1].endswith("(median of 8 rounds of 2 runs of other methods, "
                                  "this machine)")
    # Four cells of 4 rounds at 18 s: 288 s.
    assert lines[-1] == "Time left: ≈ 0:04:48 for 4 of 4 unfinished cells, one after another"


def test_this_machines_rounds_come_first_and_others_are_named(tmp_path):
    grid = grid_of(tmp_path)
    target = cell(grid, "fedrep+fedspc-s0")
    finished(grid, "fedrep+fedspc-s1", [100, 100, 100], segments=[(1, OTHER)])
    finished(grid, "fedrep-s0", [7, 9, 8])
    runs = timed_runs([grid.directory])
    here = machine_label(HERE)
    found = estimate(target, 10, runs, here)
    # Another method measured here beats the same settings measured elsewhere.
    assert (found.round_seconds, found.source, found.here) == (8, "runs of other methods",
                                                               True)
    # With nothing measured here, the other machine's rounds, named in the text.
    found = estimate(target, 10, runs, "Elsewhere, 4 cores")
    assert (found.round_seconds, found.source, found.here) == (100, "runs like it", False)
    assert found.describe().endswith("(median of 3 rounds of 1 run like it, "
                                     "on Other CPU, 8 cores)")
    lines = plan(grid)
    assert lines[-1].endswith("one after another")  # all timed on this machine


def test_a_round_belongs_to_the_machine_of_its_segment(tmp_path):
    grid = grid_of(tmp_path)
    # Rounds 1-2 on another machine, 3-4 (a resume) here: only 3-4 count here.
    finished(grid, "fedrep-s0", [100, 100, 6, 8], segments=[(1, OTHER), (3, HERE)])
    found = estimate(cell(grid, "fedrep-s1"), 10, timed_runs([grid.directory]),
                     machine_label(HERE))
    assert (found.round_seconds, found.measured_rounds, found.here) == (7, 2, True)
    # A run that recorded no machine: usable, and said to be.
    other = grid_of(tmp_path / "other")
    record(cell(other, "fedrep-s0").run_dir, cell(other, "fedrep-s0").run_config, [5, 5],
           segments=[])
    (cell(other, "fedrep-s0").run_dir / "config.json").write_text(json.dumps(
        {"run-config": cell(other, "fedrep-s0").run_config}))
    found = estimate(cell(other, "fedrep-s1"), 10, timed_runs([other.directory]), "x")
    assert found.describe().endswith("(median of 2 rounds of 1 run like it, "
                                     "machine not recorded)")
    assert found.machine is None and not found.here


def test_an_interrupted_run_is_timed_by_its_own_rounds_for_the_rounds_it_has_left(tmp_path):
    grid = grid_of(tmp_path, rounds=10)
    finished(grid, "fedrep-s0", [50] * 10)
    target = cell(grid, "fedrep-s1")
    record(target.run_dir, target.run_config, [20, 22, 24], checkpoint=3)
    found = estimate(target, 10, timed_runs([grid.directory]), machine_label(HERE))
    assert (found.rounds_left, found.round_seconds, found.source) == (7, 22, "this run")
    assert found.describe() == ("≈ 0:02:34 for 7 rounds at 0:00:22 a round "
                                "(median of 3 rounds of this run, this machine)")
    # One round of its own is too few: the runs like it decide (median of 11 rounds).
    record(target.run_dir, target.run_config, [20], checkpoint=1)
    found = estimate(target, 10, timed_runs([grid.directory]), machine_label(HERE))
    assert (found.rounds_left, found.round_seconds, found.source) == (9, 50, "runs like it")


def test_runs_of_other_settings_or_client_counts_do_not_time_a_cell(tmp_path):
    grid = grid_of(tmp_path)
    source = cell(grid, "fedrep-s0")
    record(source.run_dir, {**source.run_config, "learning-rate": 0.5}, [9, 9])
    other = grid_of(tmp_path / "clients")
    record(cell(other, "fedrep-s0").run_dir, cell(other, "fedrep-s0").run_config, [9, 9],
           clients=20)
    runs = timed_runs([grid.directory, other.directory])
    assert len(runs) == 2
    assert estimate(cell(grid, "fedrep-s1"), 10, runs, machine_label(HERE)) is None
    lines = plan(grid)
    assert lines[-1] == ("Time left: no estimate for the 6 unfinished cells (no round of "
                         "their settings measured; --times-from adds the runs of another "
                         "grid)")
    # The settings that do not change the work may differ (output-dir, seed, rounds).
    assert estimate(cell(other, "fedrep-s1"), 20, runs, machine_label(HERE)) is not None


def test_list_takes_times_from_another_grids_folder(tmp_path, capsys):
    spec = {"name": "longer", "base": {"num-rounds": 6},
            "axes": {"method": ["fedrep"], "fedspc": [False], "seed": [0]}}
    path = tmp_path / "longer.yaml"
    path.write_text(yaml.safe_dump(spec))
    shorter = grid_of(tmp_path / "short")
    finished(shorter, "fedrep-s0", [30, 30, 60, 30])
    argv = ["list", str(path), "--output-dir", str(tmp_path / "out")]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.strip().endswith("no estimate for the 1 unfinished "
                                                    "cells (no round of their settings "
                                                    "measured; --times-from adds the "
                                                    "runs of another grid)")
    assert cli.main([*argv, "--times-from", str(shorter.directory)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2].strip() == ("≈ 0:03:00 for 6 rounds at 0:00:30 a round (median of 4 "
                               "rounds of 1 run like it, this machine)")
    assert out[-1] == "Time left: ≈ 0:03:00 for 1 of 1 unfinished cells, one after another"
    # A folder that is not there is a typo, not "no estimate".
    assert cli.main([*argv, "--times-from", str(tmp_path / "nowhere")]) == 2
    assert "--times-from: no such folder" in capsys.readouterr().err


def test_a_running_grid_predicts_the_cells_left_by_their_measured_rounds(tmp_path):
    grid = grid_of(tmp_path)
    cells = [c for c in grid.cells if not c.run_config["fedspc"]]
    finished(grid, "fedrep-s0", [30, 30, 30, 30])

    def run_cell(c, log_file):  # finishes a cell with 10 s rounds
        finished(grid, c.name, [10, 10, 10, 10])
        return {"final-accuracy": 0.5}

    lines: list[str] = []
    runner.run_grid(grid, cells, runner=run_cell, echo=lines.append)
    # Two cells of 4 rounds at 30 s; then one, at the median of 30 30 30 30 10 10 10 10.
    assert lines[0].endswith("1 done, 2 to run; ≈ 0:04:00 by the rounds measured so far")
    assert lines[2].startswith("[2/3] fedrep-s1 done in") and lines[2].endswith(
        "ETA 0:01:20")
    assert lines[4].endswith("ETA 0:00:00")


def test_the_eta_adds_the_time_a_cell_takes_beyond_its_rounds(tmp_path):
    grid = grid_of(tmp_path)
    cells = [c for c in grid.cells if not c.run_config["fedspc"]]
    finished(grid, "fedrep-s0", [30, 30, 30, 30])
    now = [0.0]

    def run_cell(c, log_file):  # 100 s on the clock, 40 s of them in its rounds
        finished(grid, c.name, [10, 10, 10, 10])
        now[0] += 100.0
        return {"final-accuracy": 0.5, "wall-seconds": 40.0}

    lines: list[str] = []
    runner.run_grid(grid, cells, runner=run_cell, echo=lines.append, clock=lambda: now[0])
    # fedrep-s2 left: 4 rounds at the median 20 s, plus the 60 s fedrep-s1 spent
    # starting and finishing.
    assert lines[2] == "[2/3] fedrep-s1 done in 0:01:40, final accuracy 50.00% | " \
                       "elapsed 0:01:40 | ETA 0:02:20"
