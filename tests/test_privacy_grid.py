"""A private cell's time grows with how many clients its rounds drew (docs/privacy.md,
threat model): no line of a grid's progress, plan or files gives it, nor a time it is
part of. Nothing trains here: the cells' runner is replaced (as in test_experiments)."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path

from test_experiments import Clock, FakeRunner, grid_of

from fedspc_app.experiments import runner
from fedspc_app.experiments.runner import run_grid
from fedspc_app.runs.provenance import provenance

PRIVATE = {"dp-clipping-norm": 0.5, "dp-noise-multiplier": 1.0, "local-steps": 2}


def mixed_grid(tmp_path: Path):
    """Seeds × {private, plain}: s0-dp, s0-plain, s1-dp, ..."""
    return grid_of({"axes": {"method": ["fedper"], "seed": [0, 1, 2], "setting": {
        "dp": PRIVATE, "plain": {"dp-clipping-norm": 0.0}}}}, tmp_path)


class DrawTimedRunner(FakeRunner):
    """A plain cell takes a minute; a private one ``private_seconds[name]``, as its
    draws made it."""

    def __init__(self, clock: Clock, private_seconds: dict[str, float]) -> None:
        super().__init__(clock=clock)
        self.private_seconds = private_seconds

    def __call__(self, cell, log_file):
        summary = super().__call__(cell, log_file)
        self.clock.now += self.private_seconds.get(cell.name, 0.0) - (
            60.0 if cell.name in self.private_seconds else 0.0)
        return summary


def progress(tmp_path: Path, private_seconds: list[float]) -> list[str]:
    grid = mixed_grid(tmp_path)
    private = [c.name for c in grid.cells if c.name.endswith("-dp")]
    assert len(private) == len(private_seconds) == 3
    clock, lines = Clock(), []
    run_grid(grid, grid.cells, runner=DrawTimedRunner(clock, dict(zip(private,
                                                                      private_seconds))),
             echo=lines.append, clock=clock)
    return lines


def test_a_plain_cells_elapsed_time_and_eta_hold_no_private_cells_time(tmp_path):
    """Before, the next plain cell's elapsed time less the previous line's and its own
    "done in" gave the private cell's time (within 0.75 s, 10 of 10; correlation 0.78
    with its draws). Now, once a private cell has run, the elapsed time counts the
    plain cells' own time and says so, and the ETA leaves the private cells out: every
    line is the same whatever the private cells took."""
    short = progress(tmp_path / "short", [30.0, 45.0, 90.0])
    long = progress(tmp_path / "long", [600.0, 2000.0, 7200.0])
    assert [line.replace("/long/", "/short/") for line in long] == short
    plain = [line for line in short if line.startswith("[") and "plain done in" in line]
    assert plain[0].endswith("| elapsed 0:01:00 in the non-private cells | ETA 0:04:00")
    assert plain[-1].endswith("| elapsed 0:03:00 in the non-private cells | ETA 0:00:00")
    assert not any("0:00:30" in line or "0:07:30" in line for line in short)


def test_without_a_private_cell_the_elapsed_time_is_the_grids(tmp_path):
    grid = grid_of({"axes": {"method": ["fedper"], "seed": [0, 1]}}, tmp_path)
    clock, lines = Clock(), []
    run_grid(grid, grid.cells, runner=FakeRunner(clock=clock), echo=lines.append,
             clock=clock)
    assert lines[-2].endswith("done in 0:01:00, final accuracy 25.00% | elapsed 0:02:00"
                              " | ETA 0:00:00")


def test_a_resumed_private_cell_says_how_far_it_got_but_not_its_time(tmp_path):
    """The checkpoint's elapsed time of a private cell ("H:MM:SS run so far") is the
    run's time so far, which grows with its draws (correlation 0.59): neither the
    progress line, nor `list` / --dry-run's plan, prints it; a plain cell's still do."""
    grid = mixed_grid(tmp_path)
    private, plain = grid.cells[0], grid.cells[1]
    assert private.name.endswith("-dp") and plain.name.endswith("-plain")
    for cell in (private, plain):
        cell.run_dir.mkdir(parents=True)
        (cell.run_dir / "checkpoint.json").write_text(
            json.dumps({"round": 3, "elapsed-seconds": 125.4}))
    assert runner.progress_note(private) == " (resumes after round 3 of 10)"
    assert runner.progress_note(plain) == " (resumes after round 3 of 10, 0:02:05 run so far)"
    lines: list[str] = []
    runner.print_plan(grid, grid.cells[:2], echo=lines.append)
    listed = next(line for line in lines if f" {private.name} " in line)
    assert listed.endswith(runner.describe(private) + " (resumes after round 3 of 10)")
    assert sum("run so far" in line for line in lines) == 1
    lines = []
    run_grid(grid, [private], runner=FakeRunner(), echo=lines.append)
    assert lines[1] == (f"[1/1] {private.name}: {runner.describe(private)}"
                        " (resumes after round 3 of 10)")


def test_a_failed_cell_is_recorded_with_its_date_only(tmp_path):
    """A failed cell's end is the next cell's start: with a time of day, a bound on a
    private cell's time, whether the failed cell was private or not."""
    grid = mixed_grid(tmp_path)
    private, plain = grid.cells[0].name, grid.cells[1].name
    run_grid(grid, grid.cells[:2], runner=FakeRunner(fail={private, plain}),
             echo=lambda _: None)
    failures = json.loads((grid.directory / "failures.json").read_text())
    for name in (private, plain):
        assert date.fromisoformat(failures[name]["at"]).isoformat() == failures[name]["at"]


def test_a_runs_segments_keep_the_date_it_started_not_the_time():
    """config.json's segments[].started of a grid's consecutive cells gave a private
    cell's time by difference: its own start and the next cell's (correlation 0.72
    with its draws), and, were only a private cell's a date, the non-private cells'
    before and after it less the first one's wall-seconds (0.73, within 0.6 s)."""
    record, _ = provenance(None, 0, "cpu")
    started = record["segments"][0]["started"]
    assert date.fromisoformat(started).isoformat() == started
    previous = {"segments": [{**record["segments"][0], "started": "2025-01-31"}]}
    resumed, _ = provenance(previous, 3, "cpu")
    assert [s["started"] for s in resumed["segments"]] == ["2025-01-31", started]
