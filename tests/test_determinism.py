"""deterministic = true: PyTorch's deterministic algorithms and cuDNN flags in every
process that trains, recorded in config.json; on CPUs the results do not change."""

from __future__ import annotations

import json
import os

import pytest
import torch
from flwr.app import Context, RecordDict
from inprocess import InProcessGrid

from fedspc_app import client_app, server_app
from fedspc_app.training.precision import apply_determinism


@pytest.fixture
def restore_torch():
    """These flags are process-wide: put them back for the tests that follow."""
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2:]


def test_apply_determinism_sets_and_reports_the_flags(restore_torch, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(False)
    assert apply_determinism(False)["algorithms"] is False  # off: nothing is changed
    report = apply_determinism(True)
    assert report == {"setting": True, "algorithms": True, "cudnn-deterministic": True,
                      "cudnn-benchmark": False}
    assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def run(tmp_path, name, **keys):
    run_config = {"method": "fedrep", "fedspc": True, "num-rounds": 1, "local-epochs": 1,
                  "alpha": 0.5, "output-dir": str(tmp_path), "run-name": name, **keys}
    grid = InProcessGrid(client_app.app, 2, run_config)
    server_app.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                  run_config=run_config))
    folder = tmp_path / name
    return (json.loads((folder / "config.json").read_text()),
            json.loads((folder / "metrics.json").read_text())["rounds"])


def test_a_deterministic_run_records_it_and_on_a_cpu_changes_nothing(tmp_path,
                                                                     restore_torch):
    torch.use_deterministic_algorithms(False)
    plain_config, plain = run(tmp_path, "plain", device="cpu")
    assert plain_config["deterministic"]["setting"] is False
    config, rounds = run(tmp_path, "deterministic", deterministic=True, device="cpu")
    assert config["deterministic"] == {"setting": True, "algorithms": True,
                                       "cudnn-deterministic": True, "cudnn-benchmark": False}
    keys = ("accuracy", "loss", "train-loss", "client-accuracy")
    assert [{k: r[k] for k in keys} for r in rounds] == [{k: r[k] for k in keys}
                                                         for r in plain]
