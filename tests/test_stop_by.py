"""``stop-by``: a run, or a grid, that pauses by itself before a given time.

The arithmetic of the reckoning by hand; the run-config's and the grid command's
forms of the time; real runs of the ServerApp and ClientApp in one process that
pause at their stop-by time (and resume to the metrics of a run left alone); and
the grid runner, which starts no cell that could not finish a round in time.
"""

from __future__ import annotations

import json
import types
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import test_experiments as grids
from inprocess import InProcessGrid, run_server

from fedspc_app import client_app
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.errors import ConfigError
from fedspc_app.experiments import cli
from fedspc_app.experiments.pausing import resolve_stop_by
from fedspc_app.experiments.runner import run_grid
from fedspc_app.runs import checkpoint
from fedspc_app.runs.pause import RunPaused, next_round_ends_after

K = 3
BASE = {"method": "fedrep", "fedspc": True, "num-rounds": 3, "local-epochs": 1,
        "batch-size": 64, "alpha": 0.5, "checkpoint": True}
PASSED = "2001-01-01T00:00:00+00:00"
FAR = "2999-01-01T00:00:00+00:00"


# ----------------------------------------------------------------- the reckoning
@pytest.mark.parametrize("ends,now,deadline,late", [
    ([0.0], 10.0, 10.0, False),           # no round measured: only a passed time stops
    ([0.0], 10.0, 9.0, True),
    ([0.0, 30.0], 30.0, 60.0, False),     # a 30 s round ends at 60: in time
    ([0.0, 30.0], 30.0, 59.9, True),
    # the longest of the last three rounds (50 s), not the last (10 s) or the mean
    ([0.0, 20.0, 70.0, 80.0], 80.0, 125.0, True),
    ([0.0, 20.0, 70.0, 80.0], 80.0, 130.0, False),
    # a slow round four rounds back no longer counts: the last three took 10 s
    ([0.0, 100.0, 110.0, 120.0, 130.0], 130.0, 141.0, False),
])
def test_a_run_pauses_when_its_next_round_would_end_late(ends, now, deadline, late):
    assert next_round_ends_after(deadline, now, ends) is late


def test_the_run_config_takes_an_iso_time_with_its_offset():
    config = parse_run_config({"stop-by": "2026-12-05T18:30:00+01:00"})
    assert config.stop_by_time == datetime(2026, 12, 5, 17, 30, tzinfo=UTC)
    assert parse_run_config({"stop-by": "2026-12-05T17:30Z"}).stop_by_time == \
        config.stop_by_time
    assert parse_run_config({}).stop_by_time is None
    with pytest.raises(ConfigError, match="has no UTC offset"):
        parse_run_config({"stop-by": "2026-12-05T17:30"})
    with pytest.raises(ConfigError, match="is not an ISO 8601 time"):
        parse_run_config({"stop-by": "18:30"})


NOW = datetime(2026, 12, 5, 11, 30, tzinfo=UTC)


@pytest.mark.parametrize("text,expected", [
    ("2h30m", NOW + timedelta(hours=2, minutes=30)),
    ("90m", NOW + timedelta(minutes=90)),
    ("3h", NOW + timedelta(hours=3)),
    ("2026-12-05T13:00+01:00", datetime(2026, 12, 5, 12, 0, tzinfo=UTC)),
])
def test_the_grid_command_takes_a_duration_or_a_time(text, expected):
    assert resolve_stop_by(text, NOW) == expected.isoformat(timespec="seconds")


def test_a_clock_time_is_the_next_one_on_this_machine(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    import time
    time.tzset()
    try:
        assert resolve_stop_by("12:15", NOW) == "2026-12-05T12:15:00+00:00"
        assert resolve_stop_by("11:00", NOW) == "2026-12-06T11:00:00+00:00"  # tomorrow
        assert resolve_stop_by("2026-12-05T12:00", NOW) == "2026-12-05T12:00:00+00:00"
    finally:
        monkeypatch.undo()
        time.tzset()


@pytest.mark.parametrize("now,text,expected", [
    # Saturday 20:00 CET; the next 18:30 is Sunday's, in summer time (CEST, UTC+2)
    (datetime(2026, 3, 28, 19, 0, tzinfo=UTC), "18:30", "2026-03-29T16:30:00+00:00"),
    # Saturday 20:00 CEST; the next 18:30 is Sunday's, in winter time (CET, UTC+1)
    (datetime(2026, 10, 24, 18, 0, tzinfo=UTC), "18:30", "2026-10-25T17:30:00+00:00"),
    # Sunday 01:00 CET, before the change at 02:00: today's 12:00 is in summer time
    (datetime(2026, 3, 29, 0, 0, tzinfo=UTC), "12:00", "2026-03-29T10:00:00+00:00"),
])
def test_a_clock_time_across_a_daylight_saving_change_is_that_days_local_time(
        monkeypatch, now, text, expected):
    import time
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    try:
        assert resolve_stop_by(text, now) == expected
    finally:
        monkeypatch.undo()
        time.tzset()


@pytest.mark.parametrize("text,message", [
    ("soon", "is none of"), ("25:00", "no such clock time"), ("", "is none of"),
    ("2026-12-05T10:00Z", "has already passed"),
])
def test_a_stop_time_the_grid_command_cannot_use_is_refused(text, message):
    with pytest.raises(ConfigError, match=message):
        resolve_stop_by(text, NOW)


# ------------------------------------------------------------------- real runs
def run(tmp: Path, **overrides):
    run_config = {**BASE, "output-dir": str(tmp), "run-name": "run",
                  **{key.replace("_", "-"): value for key, value in overrides.items()}}
    error = run_server(InProcessGrid(client_app.app, K, run_config), run_config)
    metrics = json.loads((tmp / "run" / "metrics.json").read_text())["rounds"]
    return metrics, json.loads((tmp / "run" / "summary.json").read_text()), error


def accuracies(rounds):
    return [(r["round"], r["accuracy"], r["client-accuracy"]) for r in rounds]


def test_a_run_past_its_stop_by_pauses_after_one_round_and_resumes_as_if_never_stopped(
        tmp_path, caplog):
    expected, _, _ = run(tmp_path / "alone")
    with caplog.at_level("INFO", logger="flwr"):
        rounds, summary, error = run(tmp_path / "b", stop_by=PASSED)
    assert error is None and [r["round"] for r in rounds] == [1]
    assert summary["complete"] is False and summary["paused-after-round"] == 1
    assert summary["paused-by"] == f"stop-by {PASSED}"
    # The same stop-by would pause it again after each round: the log says so.
    assert "resume = true with a later stop-by (or none) continues it" in caplog.text
    # stop-by may change when a run resumes, like its other working limits
    rounds, summary, error = run(tmp_path / "b", stop_by=FAR, resume=True)
    assert error is None and summary["complete"] is True and "paused-by" not in summary
    assert accuracies(rounds) == accuracies(expected)


def test_a_run_stops_before_the_round_that_would_end_late(tmp_path, monkeypatch):
    # A clock that moves 100 s at every reading: the run starts at 100, round 1 ends
    # at 200 (the check reads 300, a round takes 100: 400 is in time for 450), round
    # 2 ends at 400 (the check reads 500: round 3 would end after 450).
    ticks = iter(range(100, 100_000, 100))
    clock = types.SimpleNamespace(time=lambda: float(next(ticks)),
                                  perf_counter=checkpoint.time.perf_counter)
    monkeypatch.setattr(checkpoint, "time", clock)
    deadline = datetime.fromtimestamp(450, UTC).isoformat()
    rounds, summary, error = run(tmp_path, stop_by=deadline)
    assert error is None and [r["round"] for r in rounds] == [1, 2]
    assert summary["paused-after-round"] == 2


@pytest.mark.parametrize("overrides", [{"stop_by": FAR}, {"stop_by": PASSED, "checkpoint": False}])
def test_a_run_with_time_enough_or_nothing_to_resume_from_runs_to_its_end(tmp_path, overrides):
    rounds, summary, error = run(tmp_path, **overrides)
    assert error is None and len(rounds) == 3 and summary["complete"] is True


# ------------------------------------------------------------------------ grids
def test_a_grid_starts_no_cell_after_its_stop_by(tmp_path):
    grid = grids.grid_of({"base": {"stop-by": PASSED},
                          "axes": {"method": ["fedper"], "fedspc": [False, True]}}, tmp_path)
    fake, lines = grids.FakeRunner(), []
    outcome = run_grid(grid, grid.cells, runner=fake, echo=lines.append)
    assert fake.calls == [] and outcome.paused and outcome.ok
    assert outcome.pause_reason == f"stop-by {PASSED} has passed"
    assert lines[-1] == (f"Grid g paused at its stop-by time ({PASSED} has passed) with 0 of"
                         " 2 selected cells done; the same command continues it.")


def test_a_grid_whose_cell_paused_at_its_stop_by_says_so(tmp_path):
    grid = grids.grid_of({"base": {"stop-by": FAR},
                          "axes": {"method": ["fedper"], "fedspc": [False, True]}}, tmp_path)

    def pausing(cell, log_file):
        raise RunPaused(4, 10, cell.name, f"stop-by {FAR}")

    lines = []
    outcome = run_grid(grid, grid.cells, runner=pausing, echo=lines.append)
    assert outcome.paused and outcome.pause_reason == f"stop-by {FAR}"
    assert lines[-2].startswith(f"[1/2] {grid.cells[0].name} paused after round 4 of 10 "
                                f"(stop-by {FAR}) |")
    assert lines[-1].startswith(f"Grid g paused at its stop-by time ({FAR}) with 0 of 2")


def test_a_grid_does_not_start_a_cell_that_could_not_finish_a_round(tmp_path):
    grid = grids.grid_of({"base": {"stop-by": "2026-12-05T12:00:00+00:00", "num-rounds": 4},
                          "axes": {"method": ["fedper"], "fedspc": [False, True]}}, tmp_path)
    # The first cell has run two rounds of 10 minutes on this machine, then stopped.
    first = grid.cells[0]
    first.run_dir.mkdir(parents=True)
    from fedspc_app.runs.provenance import machine
    (first.run_dir / "config.json").write_text(json.dumps(
        {"run-config": first.run_config, "segments": [{"first-round": 1,
                                                        "machine": machine("cpu")}]}))
    (first.run_dir / "metrics.json").write_text(json.dumps(
        {"rounds": [{"round": r, "round-seconds": 600.0} for r in (1, 2)]}))
    noon = datetime(2026, 12, 5, 12, 0, tzinfo=UTC).timestamp()
    for left, starts in ((300.0, False), (900.0, True)):  # (a started cell finishes)
        fake, lines = grids.FakeRunner(), []
        outcome = run_grid(grid, grid.cells[:1], runner=fake, echo=lines.append,
                           wall=lambda left=left: noon - left)
        assert (fake.calls == [first.name]) is starts
        if not starts:
            assert outcome.paused
            assert "0:05:00 left, a round takes ≈ 0:10:00" in lines[1]


def test_the_run_command_takes_the_stop_time_once(tmp_path, capsys):
    path = grids.write_yaml(tmp_path / "tiny.yaml", {"axes": {"method": ["fedper"]}})
    args = ["run", str(path), "--output-dir", str(tmp_path / "o"), "--dry-run"]
    assert cli.main([*args, "--stop-by", "2h"]) == 0
    assert cli.main([*args, "--stop-by", "2h", "--set", f"stop-by='{FAR}'"]) == 2
    assert "give the stop time once" in capsys.readouterr().err
    assert cli.main([*args, "--stop-by", "whenever"]) == 2
    assert "--stop-by 'whenever' is none of" in capsys.readouterr().err
