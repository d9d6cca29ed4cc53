"""A model of one's own (run-config ``model = "package.module:function"``): built from
the run seed like the shipped models, split at its ``get_classifier()``, refused with
one clear error when it cannot be, and trained with FedSPC through the real ServerApp
and ClientApp, its head never leaving the clients."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from inprocess import InProcessGrid, run_server

from fedspc_app import client_app
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.errors import ConfigError
from fedspc_app.core.protocol import ARRAYS
from fedspc_app.models.networks import build_model, split_body_head

MODULE = """
import torch
from torch import nn


class TinyNet(nn.Module):
    def __init__(self, num_classes, in_chans, image_size):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(),
                                  nn.Linear(in_chans * image_size * image_size, 16),
                                  nn.ReLU())
        self.classifier = nn.Linear(16, num_classes)

    def forward(self, x):
        return self.classifier(self.body(x))

    def get_classifier(self):
        return self.classifier


def build(num_classes, in_chans, image_size):
    return TinyNet(num_classes, in_chans, image_size)


def no_head(num_classes, in_chans, image_size):
    return nn.Linear(in_chans * image_size * image_size, num_classes)


def not_a_model(num_classes, in_chans, image_size):
    return "a string"


NOT_CALLABLE = 3
"""


def own_module(name: str, source: str, folder, monkeypatch):
    """A module of the user's own, importable as ``name`` until the test ends."""
    (folder / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


@pytest.fixture
def my_models(tmp_path, monkeypatch):
    yield own_module("my_models", MODULE, tmp_path, monkeypatch)
    sys.modules.pop("my_models", None)


def test_it_is_built_from_the_run_seed_and_split_at_its_classifier(my_models):
    first = build_model("my_models:build", num_classes=10, in_chans=1, image_size=8, seed=3)
    again = build_model("my_models:build", num_classes=10, in_chans=1, image_size=8, seed=3)
    other = build_model("my_models:build", num_classes=10, in_chans=1, image_size=8, seed=4)
    for key, value in first.state_dict().items():
        assert torch.equal(value, again.state_dict()[key])
    assert not torch.equal(first.state_dict()["body.1.weight"],
                           other.state_dict()["body.1.weight"])
    assert first.training and first(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert split_body_head(first) == (("body.1.weight", "body.1.bias"),
                                      ("classifier.weight", "classifier.bias"))


@pytest.mark.parametrize(("model", "message"), [
    ("my_models:missing", "my_models has no 'missing'"),
    ("my_models:NOT_CALLABLE", "NOT_CALLABLE is not a function"),
    ("no_such_module:build", "cannot import 'no_such_module'"),
    ("my_models:not_a_model", "it returned str, not a torch.nn.Module"),
    ("my_models:no_head", "get_classifier"),
])
def test_a_builder_that_cannot_serve_gives_one_clear_error(my_models, model, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        split_body_head(build_model(model, num_classes=10, in_chans=1, image_size=8, seed=0))


def test_the_run_config_names_it_module_colon_function(my_models):
    config = parse_run_config({"model": "my_models:build", "dataset": "digits"})
    assert config.model == "my_models:build"
    assert config.resolved_run_name == "digits-my_models.build-fedavg-a0.1-s0"
    for bad in ("my_models:", ":build", "my models:build", "my_models:build:x"):
        with pytest.raises(ConfigError, match="package.module:attribute"):
            parse_run_config({"model": bad})
    with pytest.raises(ConfigError, match="a model of your own is named"):
        parse_run_config({"model": "resnet50"})
    with pytest.raises(ConfigError, match="model-width"):
        parse_run_config({"model": "my_models:build", "model-width": 0.5})


def test_fedspc_trains_it_and_its_head_never_leaves_the_clients(my_models, tmp_path):
    config = {"model": "my_models:build", "dataset": "digits", "method": "fedrep",
              "fedspc": True, "num-rounds": 2, "local-epochs": 1, "batch-size": 32,
              "alpha": 1.0, "checkpoint": False, "output-dir": str(tmp_path),
              "run-name": "own", "num-clients": 3}
    grid = InProcessGrid(client_app.app, 3, config)
    assert run_server(grid, config) is None
    rounds = json.loads((tmp_path / "own" / "metrics.json").read_text())["rounds"]
    assert len(rounds) == 2 and all(np.isfinite(r["accuracy"]) for r in rounds)
    assert rounds[-1]["global-reference-norm"] > 0  # u-bar moved: FedSPC ran
    recorded = json.loads((tmp_path / "own" / "config.json").read_text())
    assert recorded["shared-keys"] == ["body.1.weight", "body.1.bias"]
    head = {"classifier.weight", "classifier.bias"}
    for message in [*grid.sent, *grid.replies]:
        for record_name, record in message.content.array_records.items():
            assert not head & set(record), record_name
    assert any(set(m.content.array_records.get(ARRAYS, {})) ==
               {"body.1.weight", "body.1.bias"} for m in grid.replies)


def test_the_example_in_extending_md_builds_and_splits(tmp_path, monkeypatch):
    docs = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    example = docs.split("```python\n# my_models.py\n", 1)[1].split("```", 1)[0]
    (tmp_path / "my_models.py").write_text(example)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_models", raising=False)
    config = parse_run_config({"model": "my_models:build_net", "method": "fedrep",
                               "fedspc": True})
    model = build_model(config.model, num_classes=100, in_chans=3, image_size=32, seed=0)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 100)
    assert split_body_head(model)[1] == ("head.weight", "head.bias")
    monkeypatch.delitem(sys.modules, "my_models", raising=False)


@pytest.mark.slow
def test_through_flwr_run_the_ray_workers_import_it_from_pythonpath(tmp_path):
    """The simulation's Ray workers inherit PYTHONPATH: a model module kept outside
    the project trains there, and a name that cannot be imported stops the run
    before round 1 with its reason."""
    import os
    import subprocess

    code = tmp_path / "code"
    code.mkdir()
    (code / "my_models.py").write_text(textwrap.dedent(MODULE))
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = tmp_path / "out"

    def simulate(model: str) -> subprocess.CompletedProcess:
        sets = (f"model='{model}' method='fedrep' fedspc=true num-rounds=2 "
                f"local-epochs=1 checkpoint=false output-dir='{out}'")
        return subprocess.run([sys.executable, "-m", "fedspc_app.simulate", "--clients",
                               "3", "--set", sets], env=env, capture_output=True,
                              text=True, timeout=600, check=False)

    done = simulate("my_models:build")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    run_dir = out / "digits-my_models.build-fedrep+fedspc-a0.1-s0"
    rounds = json.loads((run_dir / "metrics.json").read_text())["rounds"]
    assert len(rounds) == 2 and rounds[-1]["accuracy"] > 0.3
    failed = simulate("my_models:missing")
    assert failed.returncode != 0
    assert "my_models has no 'missing'" in failed.stdout + failed.stderr


METHODS_MODULE = """
from fedspc_app.core.methods import Method, Phase

FEDPER_WARMUP = Method(
    "fedper-warmup", shared="body",
    phases=(Phase("head", "fedrep_head_epochs"), Phase("all", "local_epochs")),
    summary="FedPer with a head warm-up before each round",
)
FEDREP_AGAIN = Method(
    "fedrep-again", shared="body",
    phases=(Phase("head", "fedrep_head_epochs"), Phase("body", "local_epochs")),
)
BAD_FIELD = Method("bad", shared="body", phases=(Phase("all", "epochs_typo"),))
NOT_A_METHOD = {"shared": "body"}
"""


@pytest.fixture
def my_methods(tmp_path, monkeypatch):
    yield own_module("my_methods", METHODS_MODULE, tmp_path, monkeypatch)
    sys.modules.pop("my_methods", None)


def test_a_method_of_ones_own_is_named_module_colon_name(my_methods):
    from fedspc_app.core.methods import get_method

    method = get_method("my_methods:FEDPER_WARMUP")
    assert method.name == "fedper-warmup" and method.shared == "body"
    config = parse_run_config({"method": "my_methods:FEDPER_WARMUP", "fedspc": True})
    assert config.resolved_run_name == "digits-cnn-my_methods.FEDPER_WARMUP+fedspc-a0.1-s0"
    for value, message in (("my_methods:BAD_FIELD", "'epochs_typo' is not a run-config"),
                           ("my_methods:NOT_A_METHOD", "dict, not a fedspc_app"),
                           ("my_methods:MISSING", "my_methods has no 'MISSING'"),
                           ("other_methods:X", "cannot import 'other_methods'"),
                           ("my_methods:", "package.module:attribute")):
        with pytest.raises(ConfigError, match=message):
            parse_run_config({"method": value})


def test_a_method_of_ones_own_trains_as_the_registered_one_it_copies(my_methods, tmp_path):
    """FEDREP_AGAIN describes FedRep: the same rounds, bit for bit, with FedSPC."""
    def rounds(method: str) -> list[dict]:
        config = {"method": method, "fedspc": True, "num-rounds": 2, "local-epochs": 1,
                  "batch-size": 32, "alpha": 1.0, "checkpoint": False, "num-clients": 3,
                  "output-dir": str(tmp_path), "run-name": method.replace(":", "."),
                  "deterministic": True}
        assert run_server(InProcessGrid(client_app.app, 3, config), config) is None
        return json.loads((tmp_path / config["run-name"] / "metrics.json").read_text())[
            "rounds"]

    own, registered = rounds("my_methods:FEDREP_AGAIN"), rounds("fedrep")
    for key in ("accuracy", "train-loss", "global-reference-norm"):
        assert [r[key] for r in own] == [r[key] for r in registered], key


def test_the_method_example_in_extending_md_is_a_method(tmp_path, monkeypatch):
    from fedspc_app.core.methods import get_method

    docs = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    example, rest = docs.split("```python\n# my_methods.py\n", 1)[1].split("```", 1)
    (tmp_path / "my_methods.py").write_text(example)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_methods", raising=False)
    named = rest.split('```toml\nmethod = "', 1)[1].split('"', 1)[0]  # the next block
    assert named == "my_methods:FEDPER_WARMUP"
    assert [p.train for p in get_method(named).phases] == ["head", "all"]
    assert parse_run_config({"method": named, "fedspc": True}).fedspc
    monkeypatch.delitem(sys.modules, "my_methods", raising=False)
