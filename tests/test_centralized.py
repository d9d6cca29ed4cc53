"""The centralized (pooled-data) reference: fedspc_app.experiments.centralized and the
grid runner's centralized cells."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import uuid
from pathlib import Path

import pytest

from fedspc_app.core.errors import ConfigError
from fedspc_app.experiments import cli, runner
from fedspc_app.experiments.centralized import epoch_learning_rate
from fedspc_app.experiments.grid import SimulationSettings, expand_grid
from fedspc_app.experiments.runner import CellRunner, run_centralized_cell, run_grid
from fedspc_app.launch.superlink import SimulationFailed


def test_learning_rate_schedules():
    assert epoch_learning_rate(0.1, 7, 10, "constant") == 0.1
    assert epoch_learning_rate(0.1, 1, 10, "cosine") == pytest.approx(0.1)
    assert epoch_learning_rate(0.1, 6, 10, "cosine") == pytest.approx(0.05)
    assert epoch_learning_rate(0.1, 10, 10, "cosine") == pytest.approx(
        0.05 * (1 + math.cos(math.pi * 0.9)))
    with pytest.raises(ConfigError, match="lr-schedule"):
        epoch_learning_rate(0.1, 1, 10, "step")


def test_one_epoch_of_the_cnn_on_digits_learns_and_writes_a_results_folder(tmp_path):
    """Through the grid runner: ``python -m fedspc_app.experiments centralized`` in a
    subprocess. One epoch of 45 batches with momentum reaches 0.90-0.96 on the 10
    digit classes (seeds 0-2), far above the 0.1 of chance."""
    grid = expand_grid(
        {"base": {"batch-size": 32}, "axes": {"method": ["fedper"]},
         "centralized": {"epochs": 1, "learning-rate": 0.05, "momentum": 0.9}},
        name="c", output_dir=tmp_path)
    cell = grid.cells[-1]
    assert (cell.kind, cell.name) == ("centralized", "centralized-digits-cnn")
    log = tmp_path / "central.log"
    summary = run_centralized_cell(cell, log, timeout=300)
    run_dir = tmp_path / "c" / "centralized-digits-cnn"
    assert summary == json.loads((run_dir / "summary.json").read_text())
    assert summary["complete"] is True and summary["mode"] == "centralized"
    assert summary["epochs"] == 1 and summary["final-epoch"] == summary["best-epoch"] == 1
    assert summary["final-accuracy"] > 0.75
    metrics = json.loads((run_dir / "metrics.json").read_text())
    (row,) = metrics["epochs"]
    assert row["train-images"] == 1438  # the whole training set = every client's data
    assert row["learning-rate"] == 0.05 and row["accuracy"] == summary["final-accuracy"]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["mode"] == "centralized" and config["dataset"]["test"] == 359
    assert config["run-config"]["learning-rate"] == 0.05
    assert config["run-config"]["batch-size"] == 32
    assert config["run-config"]["momentum"] == 0.9
    assert (run_dir / "metrics.csv").read_text().startswith("epoch,accuracy,loss,")
    assert "[centralized] epoch 1/1 | accuracy" in log.read_text()


def test_bad_input_fails_cleanly(tmp_path, capsys):
    assert cli.main(["centralized", "--set", "model='nope'", "--output-dir", str(tmp_path),
                     "--epochs", "1"]) == 2
    assert "run-config 'model' = 'nope'" in capsys.readouterr().err
    assert cli.main(["centralized", "--epochs", "0", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedspc: epochs and eval-every must be >= 1") and err.count("\n") == 1
    assert not any(tmp_path.iterdir())


def test_a_failed_centralized_run_raises(tmp_path):
    grid = expand_grid({"axes": {"method": ["fedper"]}, "centralized": {"epochs": 1}},
                       name="c", output_dir=tmp_path)
    # An option the subprocess rejects at once (a grid would not let it through).
    cell = dataclasses.replace(grid.cells[-1], centralized={
        **grid.cells[-1].centralized, "eval-every": 0})
    with pytest.raises(SimulationFailed, match="did not complete \\(exit code 2\\)"):
        run_centralized_cell(cell, tmp_path / "c.log", timeout=120)
    assert "eval-every must be >= 1" in (tmp_path / "c.log").read_text()


def _running(marker: str) -> list[int]:
    """PIDs of the processes whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_text():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_silent_hang_is_killed_at_the_timeout(tmp_path, monkeypatch):
    """A centralized cell that prints nothing and never ends is stopped after its
    timeout and recorded as failed; its process does not outlive the cell."""
    grid = expand_grid({"axes": {"method": ["fedper"]}, "centralized": {"epochs": 1}},
                       name="c", output_dir=tmp_path)
    cell = grid.cells[-1]
    marker = f"hang-{uuid.uuid4().hex}"
    monkeypatch.setattr(runner, "centralized_command", lambda cell, config: [
        sys.executable, "-c", f"import time; time.sleep(30)  # {marker}"])
    # The child would sleep 30 s and exit cleanly: only the timer's kill raises here.
    with pytest.raises(TimeoutError, match="exceeded 2 s"):
        run_centralized_cell(cell, tmp_path / "c.log", timeout=2)
    assert _running(marker) == []
    outcome = run_grid(grid, [cell], runner=CellRunner(SimulationSettings(timeout=2)),
                       echo=lambda _: None)
    assert list(outcome.failed) == [cell.name]
    failures = json.loads((grid.directory / "failures.json").read_text())
    assert "exceeded 2 s" in failures[cell.name]["error"]
    assert _running(marker) == []
