"""FedSPC on any split: ``shared-keys``/``personal-keys`` patterns and methods registered in code.

The small CNN's state-dict keys are ``features.conv{1,2}.{weight,bias}``, ``fc.*`` and
``head.*``; the expected splits below are written out by hand from them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_inprocess import OUTPUT, run_app, train_messages, train_replies
from torch import nn

from fedspc_app.core.config import parse_run_config
from fedspc_app.core.errors import ConfigError
from fedspc_app.core.methods import METHODS, Method, Phase, get_method, register
from fedspc_app.data.datasets import load_dataset
from fedspc_app.models.run_model import make_model
from fedspc_app.models.split import parameter_split

CONV = ("features.conv1.weight", "features.conv1.bias",
        "features.conv2.weight", "features.conv2.bias")
FC = ("fc.weight", "fc.bias")
HEAD = ("head.weight", "head.bias")


@pytest.fixture(scope="module")
def model():
    return make_model(parse_run_config({}), load_dataset("digits", None))


def test_the_cnn_has_the_keys_these_tests_are_written_for(model):
    assert tuple(model.state_dict()) == CONV + FC + HEAD


@pytest.mark.parametrize(("shared", "personal", "expect_shared"), [
    ("", "head.*", CONV + FC),
    ("", "fc.*, head.*", CONV),
    ("", "features.conv1.*,head.*", CONV[2:] + FC),
    ("features.*", "", CONV),
    ("features.*,fc.weight", "fc.bias,head.*", CONV + ("fc.weight",)),
    ("*.weight", "", ("features.conv1.weight", "features.conv2.weight", "fc.weight",
                      "head.weight")),
])
def test_declared_patterns_resolve_to_these_keys(model, shared, personal, expect_shared):
    split = parameter_split(model, get_method("fedavg"), shared_keys=shared,
                            personal_keys=personal)
    assert split.shared == expect_shared
    assert split.personal == tuple(k for k in CONV + FC + HEAD if k not in expect_shared)
    assert split.corrected == expect_shared  # the CNN has no buffers


def test_the_methods_phases_keep_their_roles_on_a_declared_split(model):
    # FedRep trains "head" then "body": on a declared split, the personal set, then the
    # shared set. LG-FedAvg shares its "head": the declared shared set takes that role.
    fedrep = parameter_split(model, get_method("fedrep"), personal_keys="features.conv1.*")
    assert fedrep.trainable("head") == CONV[:2]
    assert fedrep.trainable("body") == CONV[2:] + FC + HEAD
    lg = parameter_split(model, get_method("lgfedavg"), personal_keys="features.*")
    assert lg.shared == FC + HEAD and lg.head == FC + HEAD and lg.body == CONV


@pytest.mark.parametrize(("shared", "personal", "message"), [
    ("", "heads.*", "'personal-keys': pattern 'heads.*' matches no state-dict key"),
    ("features.*", "fc.*", "leave head.weight, head.bias unassigned"),
    ("features.*,fc.*", "fc.bias,head.*", "both match fc.bias"),
    ("", "*", "no trainable parameter"),
    ("", " , ", "hold no pattern"),
])
def test_a_bad_declaration_is_one_clear_error(model, shared, personal, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("*", r"\*")):
        parameter_split(model, get_method("fedper"), shared_keys=shared,
                        personal_keys=personal)


class _Aliased(nn.Module):
    """A model of one's own with one module under two names (``backbone`` is ``body``)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
        self.backbone = self.body
        self.head = nn.Linear(4, 5)

    def get_classifier(self):
        return self.head


@pytest.mark.parametrize("local_buffers", [False, True])
def test_an_aliased_module_is_on_one_side_with_or_without_dp(local_buffers):
    # Under differential privacy only buffers stay local: the alias's parameters are
    # parameters too, not buffers, so they are shared with the module they alias.
    split = parameter_split(_Aliased(), get_method("fedavg"), local_buffers=local_buffers)
    assert split.personal == ()
    assert {"body.0.weight", "backbone.0.weight"} <= split.parameters & set(split.shared)


def test_a_declared_split_through_an_aliased_module_is_refused():
    with pytest.raises(ConfigError, match="'body.0.weight' \\(shared\\) and "
                                          "'backbone.0.weight' \\(personal\\) are one tensor"):
        parameter_split(_Aliased(), get_method("fedper"), shared_keys="body.*",
                        personal_keys="backbone.*,head.*")


def rounds(metrics):
    return [{k: v for k, v in row.items() if "second" not in k}
            for row in metrics["rounds"]]


def test_fedpers_split_declared_is_fedpers_split(model):
    fedper = get_method("fedper")
    assert parameter_split(model, fedper, personal_keys="head.*") == \
        parameter_split(model, fedper)


@pytest.mark.parametrize("fedspc", [False, True])
def test_fedpers_split_declared_gives_fedpers_results_exactly(fedspc):
    # FedAvg's one phase on every parameter, with the head declared personal, is FedPer.
    fedper_grid, fedper = run_app("fedper", fedspc)
    declared_grid, declared = run_app("fedavg", fedspc, shared_keys="features.*,fc.*")
    # Every server message carries its run's name (the runs are named apart); the rest
    # of the traffic is the same, byte for byte.
    names = [grid.contexts[1].run_config["run-name"] for grid in (declared_grid, fedper_grid)]
    name_bytes = len(fedper_grid.sent) // len(fedper["rounds"]) * (len(names[0])
                                                                  - len(names[1]))
    for row_declared, row_fedper in zip(declared["rounds"], fedper["rounds"], strict=True):
        assert row_declared["bytes-sent"] - row_fedper["bytes-sent"] == name_bytes
    without_sent = [[{k: v for k, v in row.items() if k != "bytes-sent"} for row in rounds(m)]
                    for m in (declared, fedper)]
    assert without_sent[0] == without_sent[1]


def test_a_split_no_method_uses_composes_with_fedspc():
    grid, metrics = run_app("fedrep", True, personal_keys="features.conv1.*,head.*")
    shared = CONV[2:] + FC
    for message in grid.sent + grid.replies:
        assert not message.has_error(), message.error
        for record in message.content.array_records.values():
            assert set(record.keys()) <= set(shared)
    for message in train_messages(grid, 1) + train_messages(grid, 2):
        assert set(message.content.array_records["arrays"].keys()) == set(shared)
        assert set(message.content.array_records["global-reference"].keys()) == set(shared)
    assert len(train_replies(grid)) == 2 * 3
    config = json.loads((OUTPUT / metrics["run-name"] / "config.json").read_text())
    assert config["split"].startswith("declared")
    assert config["shared-keys"] == list(shared)
    assert config["personal-keys"] == list(CONV[:2] + HEAD)
    first, last = metrics["rounds"]
    assert np.isfinite(last["loss"]) and last["loss"] < first["loss"]
    assert last["accuracy"] > 0.3  # digits, chance 10%


def test_a_method_registered_in_code_runs_with_fedspc():
    method = register(Method(
        "fedper-headfirst", "body",
        (Phase("head", "fedrep_head_epochs"), Phase("all", "local_epochs")),
        summary="test method: a personal-head warm-up, then every parameter"))
    try:
        grid, metrics = run_app("fedper-headfirst", True)
        split = parameter_split(make_model(parse_run_config({}), load_dataset("digits", None)),
                                method)
        assert split.shared == CONV + FC
        for message in grid.sent + grid.replies:
            assert not message.has_error(), message.error
            for record in message.content.array_records.values():
                assert not set(record.keys()) & set(HEAD)
        first, last = metrics["rounds"]
        assert last["loss"] < first["loss"] and last["accuracy"] > 0.3
    finally:
        METHODS.pop("fedper-headfirst")
