"""Weights & Biases (run-config ``wandb = true``), offline: the logged history read back
from the run's .wandb file and compared with metrics.csv."""

from __future__ import annotations

import csv
import json
import struct
import sys
from pathlib import Path

import pytest
from inprocess import InProcessGrid, run_server

from fedspc_app import client_app
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.errors import ConfigError
from fedspc_app.runs.wandb_log import ID_FILE, check_wandb

pytest.importorskip("wandb")  # the [wandb] extra, part of [test]
from wandb.proto import wandb_internal_pb2


def records(path: Path):
    """The protobuf records of a .wandb file (the LevelDB log format: 32 KiB blocks of
    chunks with a 7-byte header, after a 7-byte file header)."""
    data, block, position, pending = path.read_bytes(), 32768, 7, b""
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if length == 0 and kind == 0:
            position += left
            continue
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def history(run_dir: Path) -> dict[int, dict[str, float]]:
    """Every logged step's values, over every offline segment of the run."""
    steps: dict[int, dict[str, float]] = {}
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for record in records(path):
            if record.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                steps[int(record.history.step.num)] = row
    return steps


def run(tmp: Path, **overrides):
    config = {"method": "fedrep", "fedspc": True, "num-rounds": 2, "local-epochs": 1,
              "batch-size": 64, "wandb": True, "output-dir": str(tmp), "run-name": "wb",
              **overrides}
    return run_server(InProcessGrid(client_app.app, 2, config), config)


def test_every_number_of_metrics_csv_is_in_the_wandb_history(tmp_path):
    assert run(tmp_path) is None
    run_dir = tmp_path / "wb"
    logged = history(run_dir)
    with (run_dir / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert sorted(logged) == [1, 2]
    for row in rows:
        step = logged[int(row["round"])]
        for column, tag in (("accuracy", "accuracy/accuracy"), ("loss", "loss/loss"),
                            ("train-loss", "loss/train-loss"),
                            ("global-reference-norm", "drift/global-reference-norm"),
                            ("bytes-sent", "traffic/bytes-sent")):
            assert step[tag] == pytest.approx(float(row[column]), rel=1e-12), column
    metrics = json.loads((run_dir / "metrics.json").read_text())["rounds"]
    for client, value in metrics[-1]["client-accuracy"].items():
        assert logged[2][f"client-accuracy/{client}"] == pytest.approx(value)
    assert json.loads((run_dir / ID_FILE).read_text())["id"]


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path):
    assert run(tmp_path, **{"keep-client-state": True}) is None
    first = json.loads((tmp_path / "wb" / ID_FILE).read_text())["id"]
    assert run(tmp_path, **{"num-rounds": 3, "resume": True,
                             "keep-client-state": True}) is None  # extend to 3
    assert json.loads((tmp_path / "wb" / ID_FILE).read_text())["id"] == first
    segments = sorted((tmp_path / "wb").glob("wandb/offline-run-*"))
    assert len(segments) == 2 and all(s.name.endswith(first) for s in segments)
    assert sorted(history(tmp_path / "wb")) == [1, 2, 3]


def test_a_missing_package_is_one_error_before_round_1(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError, match=r"wandb = true needs the wandb package"):
        check_wandb(parse_run_config({"wandb": True}))
    check_wandb(parse_run_config({}))  # off: nothing asked
