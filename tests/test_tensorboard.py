"""TensorBoard scalars (run-config ``tensorboard = true``): read back, they are the
numbers of metrics.csv and metrics.json, one value per round and tag, also after a
resume; without the package the run stops before round 1."""

from __future__ import annotations

import csv
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, MetricRecord, RecordDict
from inprocess import InProcessGrid
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from fedspc_app import client_app, server_app
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.errors import ConfigError
from fedspc_app.runs.results import METRICS_CSV, METRICS_JSON, SCALAR_COLUMNS, RunRecorder
from fedspc_app.runs.tensorboard import FOLDER, check_tensorboard, tag

Scalars = dict[str, dict[int, float]]


def f32(value: float) -> float:
    """``value`` as TensorBoard stores a scalar (float32)."""
    return float(np.float32(value))


def read_scalars(run_dir: Path) -> Scalars:
    """Every scalar of ``<run_dir>/tensorboard/`` as TensorBoard reads it (purges
    applied): tag -> step -> value; a step written twice for a tag fails."""
    accumulator = EventAccumulator(str(run_dir / FOLDER), size_guidance={SCALARS: 0})
    accumulator.Reload()
    scalars: Scalars = {}
    for name in accumulator.Tags()["scalars"]:
        events = accumulator.Scalars(name)
        steps = [event.step for event in events]
        assert len(steps) == len(set(steps)), f"{name}: steps {steps}"
        scalars[name] = {event.step: event.value for event in events}
    return scalars


def recorded_scalars(run_dir: Path) -> Scalars:
    """What the run recorded, as TensorBoard should show it: every number of a
    metrics.json round (the round's scalars and per-client values)."""
    expected: Scalars = defaultdict(dict)
    for row in json.loads((run_dir / METRICS_JSON).read_text())["rounds"]:
        step = row["round"]
        for column, value in row.items():
            if isinstance(value, dict):
                for client, client_value in value.items():
                    if client_value is not None:
                        expected[f"{column}/{client}"][step] = f32(client_value)
            elif column != "round" and isinstance(value, (int, float)):
                expected[tag(column)][step] = f32(value)
    return dict(expected)


def assert_scalars_are_the_metrics(run_dir: Path) -> Scalars:
    """The read-back scalars equal metrics.json's numbers, and every filled cell of
    metrics.csv is among them."""
    scalars = read_scalars(run_dir)
    assert scalars == recorded_scalars(run_dir)
    with (run_dir / METRICS_CSV).open(newline="") as file:
        cells = [(int(row["round"]), column, text) for row in csv.DictReader(file)
                 for column, text in row.items() if column != "round" and text]
    assert cells
    for step, column, text in cells:
        assert scalars[tag(column)][step] == f32(float(text)), (column, step)
    return scalars


def test_every_metrics_column_has_a_named_group():
    assert [c for c in SCALAR_COLUMNS if tag(c).startswith("other/")] == ["round"]
    assert tag("accuracy") == "accuracy/accuracy"
    assert tag("bytes-sent") == "traffic/bytes-sent"
    assert tag("update-norm") == "drift/update-norm"
    assert tag("train-evaluate-seconds") == "time/train-evaluate-seconds"


def test_a_run_writes_every_metric_it_records_as_scalars(tmp_path):
    run_config = {"method": "fedrep", "fedspc": True, "num-rounds": 2, "local-epochs": 1,
                  "batch-size": 64, "alpha": 0.5, "evaluate-before-aggregation": True,
                  "tensorboard": True, "output-dir": str(tmp_path), "run-name": "run"}
    grid = InProcessGrid(client_app.app, 3, run_config)
    server_app.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                  run_config=run_config))
    scalars = assert_scalars_are_the_metrics(tmp_path / "run")
    for name in ("accuracy/accuracy", "loss/train-loss", "traffic/bytes-received",
                 "drift/update-norm", "time/round-seconds", "client-accuracy/0",
                 "client-update-norms/2", "client-accuracy-before-aggregation/1"):
        assert sorted(scalars[name]) == [1, 2], name


def records(server_round: int, attempt: int) -> tuple[MetricRecord, MetricRecord]:
    """A round's aggregated training and evaluation metrics (as the strategy hands
    them to the recorder); ``attempt`` makes a rerun of a round report other values."""
    value = server_round / 10 + attempt / 100
    train = MetricRecord({"train-loss": 2.0 - value, "clients": 2, "examples-seen": 300,
                          "update-norm": value, "train-client-ids": [0, 1],
                          "client-update-norms": [value, 2 * value]})
    evaluate = MetricRecord({"accuracy": value, "weighted-accuracy": value / 2,
                             "loss": 1.0 - value, "clients": 2, "client-ids": [0, 1],
                             "client-accuracy": [value, value / 3]})
    return train, evaluate


PRIVATE = {"dp-clipping-norm": 1.0, "dp-noise-multiplier": 1.0, "local-steps": 5}


def recorder(tmp_path: Path, tensorboard: bool = True, dp: bool = False) -> RunRecorder:
    config = parse_run_config({"output-dir": str(tmp_path), "run-name": "run",
                               "num-rounds": 4, "tensorboard": tensorboard,
                               **(PRIVATE if dp else {})})
    return RunRecorder(config, echo=lambda _: None)


def interrupted(tmp_path: Path, rounds: int, tensorboard: bool = True,
                dp: bool = False) -> RunRecorder:
    """A run that recorded ``rounds`` rounds and stopped (no summary)."""
    first = recorder(tmp_path, tensorboard, dp)
    first.start()
    for server_round in range(1, rounds + 1):
        first.on_round_end(server_round, *records(server_round, attempt=0))
    if tensorboard:  # on disk after each round, for a live TensorBoard
        assert read_scalars(first.run_dir) == recorded_scalars(first.run_dir)
    first.scalars.close()  # what a killed process leaves
    # An event file is named by its second of creation: the next one sorts after it.
    time.sleep(1.01 - time.time() % 1)
    return first


def resume(tmp_path: Path, earlier: RunRecorder, after: int, rounds: int = 4,
           dp: bool = False) -> None:
    """Continue ``earlier`` from its checkpoint after round ``after`` (rerun values)."""
    resumed = recorder(tmp_path, dp=dp)
    checkpoint = earlier.rounds[:after]
    resumed.start(rounds=checkpoint, elapsed=checkpoint[-1]["elapsed-seconds"])
    for server_round in range(after + 1, rounds + 1):
        resumed.on_round_end(server_round, *records(server_round, attempt=1))
    resumed.finish()


def test_a_resumed_run_replaces_the_rounds_after_its_checkpoint(tmp_path):
    first = interrupted(tmp_path, rounds=3)
    resume(tmp_path, first, after=2)
    run_dir = tmp_path / "run"
    assert len(list((run_dir / FOLDER).glob("events.out.tfevents.*"))) == 2
    scalars = assert_scalars_are_the_metrics(run_dir)
    assert scalars["accuracy/accuracy"] == {1: f32(0.1), 2: f32(0.2), 3: f32(0.31),
                                            4: f32(0.41)}
    assert scalars["client-update-norms/1"][3] == f32(0.62)


def test_a_private_runs_events_hold_no_time_and_resume_as_any_run(tmp_path):
    """Under differential privacy no event file holds a time, in its name or in any
    event (torch's writer stamps its first events and its name with the time it
    opened: a run's start, from which a grid's private cells' times follow); a resumed
    run's file purges the rounds after the checkpoint as torch's does."""
    first = interrupted(tmp_path, rounds=3, dp=True)
    resume(tmp_path, first, after=2, dp=True)
    folder = tmp_path / "run" / FOLDER
    names = sorted(path.name for path in folder.iterdir())
    assert names == ["events.out.tfevents.0000000000.private.000000",
                     "events.out.tfevents.0000000000.private.000001"]
    events = [event for name in names
              for event in EventFileLoader(str(folder / name)).Load()]
    assert len(events) > 8 and {event.wall_time for event in events} == {0.0}
    scalars = assert_scalars_are_the_metrics(tmp_path / "run")
    assert scalars["accuracy/accuracy"] == {1: f32(0.1), 2: f32(0.2), 3: f32(0.31),
                                            4: f32(0.41)}


def test_turned_on_at_resume_it_writes_the_checkpoint_rounds_too(tmp_path):
    first = interrupted(tmp_path, rounds=2, tensorboard=False)
    assert not (tmp_path / "run" / FOLDER).exists()
    resume(tmp_path, first, after=2)
    scalars = assert_scalars_are_the_metrics(tmp_path / "run")
    assert sorted(scalars["loss/loss"]) == [1, 2, 3, 4]


def test_a_new_run_in_the_folder_drops_the_earlier_runs_events(tmp_path):
    interrupted(tmp_path, rounds=3)
    again = recorder(tmp_path)  # overwrite = true, or a run without a checkpoint
    again.start()
    again.on_round_end(1, *records(1, attempt=2))
    again.finish()
    assert len(list((tmp_path / "run" / FOLDER).glob("events.out.tfevents.*"))) == 1
    scalars = assert_scalars_are_the_metrics(tmp_path / "run")
    assert scalars["accuracy/accuracy"] == {1: f32(0.12)}


def test_without_the_package_the_run_stops_before_round_1(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # not installed
    check_tensorboard(parse_run_config({"tensorboard": False}))
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[tensorboard\]"'):
        check_tensorboard(parse_run_config({"tensorboard": True}))
    run_config = {"tensorboard": True, "output-dir": str(tmp_path), "run-name": "run"}
    grid = InProcessGrid(client_app.app, 2, run_config)
    with pytest.raises(SystemExit, match="tensorboard = true needs the tensorboard package"):
        server_app.main(grid, Context(run_id=1, node_id=0, node_config={},
                                      state=RecordDict(), run_config=run_config))
    assert grid.queries == [] and grid.sent == []
    assert not (tmp_path / "run").exists()
