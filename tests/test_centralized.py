"""The centralized (pooled-data) reference: fedspc_app.centralized."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from fedspc_app import experiments
from fedspc_app.centralized import epoch_learning_rate, main
from fedspc_app.core.errors import ConfigError
from fedspc_app.launch.superlink import SimulationFailed


def test_learning_rate_schedules():
    assert epoch_learning_rate(0.1, 7, 10, "constant") == 0.1
    assert epoch_learning_rate(0.1, 1, 10, "cosine") == pytest.approx(0.1)
    assert epoch_learning_rate(0.1, 6, 10, "cosine") == pytest.approx(0.05)
    assert epoch_learning_rate(0.1, 10, 10, "cosine") == pytest.approx(
        0.05 * (1 + math.cos(math.pi * 0.9)))
    with pytest.raises(ConfigError, match="lr-schedule"):
        epoch_learning_rate(0.1, 1, 10, "step")


def test_one_epoch_of_the_cnn_on_digits_writes_a_results_folder(tmp_path):
    """Through the grid runner: ``python -m fedspc_app.centralized`` in a subprocess."""
    grid = experiments.expand_grid(
        {"base": {"batch-size": 128}, "axes": {"method": ["fedper"]},
         "centralized": {"epochs": 1, "learning-rate": 0.05}},
        name="c", output_dir=tmp_path)
    cell = grid.cells[-1]
    assert (cell.kind, cell.name) == ("centralized", "centralized-digits-cnn")
    log = tmp_path / "central.log"
    summary = experiments.run_centralized_cell(cell, log, timeout=300)
    run_dir = tmp_path / "c" / "centralized-digits-cnn"
    assert summary == json.loads((run_dir / "summary.json").read_text())
    assert summary["complete"] is True and summary["mode"] == "centralized"
    assert summary["epochs"] == 1 and summary["final-epoch"] == summary["best-epoch"] == 1
    assert 0.1 < summary["final-accuracy"] <= 1.0  # above chance after one epoch
    metrics = json.loads((run_dir / "metrics.json").read_text())
    (row,) = metrics["epochs"]
    assert row["train-images"] == 1438  # the whole training set = every client's data
    assert row["learning-rate"] == 0.05 and row["accuracy"] == summary["final-accuracy"]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["mode"] == "centralized" and config["dataset"]["test"] == 359
    assert config["run-config"]["learning-rate"] == 0.05
    assert config["run-config"]["batch-size"] == 128
    assert (run_dir / "metrics.csv").read_text().startswith("epoch,accuracy,loss,")
    assert "[centralized] epoch 1/1 | accuracy" in log.read_text()


def test_bad_input_fails_cleanly(tmp_path, capsys):
    assert main(["--set", "model='nope'", "--output-dir", str(tmp_path), "--epochs", "1"]) == 1
    assert "run-config 'model' = 'nope'" in capsys.readouterr().err
    assert main(["--epochs", "0", "--output-dir", str(tmp_path)]) == 1
    assert not any(tmp_path.iterdir())


def test_a_failed_centralized_run_raises(tmp_path):
    grid = experiments.expand_grid(
        {"axes": {"method": ["fedper"]}, "centralized": {"epochs": 1}},
        name="c", output_dir=tmp_path)
    # An option the subprocess rejects at once (a grid would not let it through).
    cell = dataclasses.replace(grid.cells[-1], centralized={
        **grid.cells[-1].centralized, "eval-every": 0})
    with pytest.raises(SimulationFailed, match="did not complete \\(exit code 1\\)"):
        experiments.run_centralized_cell(cell, tmp_path / "c.log", timeout=120)
    assert "eval-every must be >= 1" in (tmp_path / "c.log").read_text()
