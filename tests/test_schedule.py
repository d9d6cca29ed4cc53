"""The clients' learning rate over rounds (lr-schedule): the η sequence, its use in
Algorithm 1, and the messages that carry it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flwr.app import ConfigRecord
from inprocess import InProcessGrid, run_server
from test_strategies import (
    BN,
    ETA,
    K_NODES,
    PLANS,
    START,
    WK,
    FakeGrid,
    arrays_of,
    f32,
    record,
    spc_reply,
)

from fedspc_app import client_app
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.errors import ConfigError
from fedspc_app.training.schedule import round_learning_rates
from strategies import FedSPC


def rates(**settings) -> tuple[float, ...]:
    return round_learning_rates(parse_run_config({"learning-rate": 0.1, "num-rounds": 7,
                                                  **settings}))


def test_the_rates_follow_the_schedulers_closed_forms():
    t = np.arange(7)
    assert rates() == (0.1,) * 7
    np.testing.assert_allclose(rates(**{"lr-schedule": "exponential", "lr-decay": 0.9}),
                               0.1 * 0.9 ** t, rtol=1e-12)
    cosine = 0.01 + (0.1 - 0.01) * (1 + np.cos(np.pi * t / 6)) / 2
    np.testing.assert_allclose(rates(**{"lr-schedule": "cosine", "lr-min": 0.01}), cosine,
                               rtol=1e-12)
    np.testing.assert_allclose(
        rates(**{"lr-schedule": "step", "lr-decay": 0.5, "lr-step-rounds": 3}),
        0.1 * 0.5 ** (t // 3), rtol=1e-12)
    with pytest.raises(ConfigError, match="lr-decay"):
        rates(**{"lr-decay": 1.5})


@pytest.mark.usefixtures("task_identity")
def test_fedspc_divides_by_each_rounds_eta():
    """The plans of test_strategies through FedSPC with eta halved in round 2, against
    Algorithm 1 in float64 with that eta."""
    etas = (ETA, ETA / 2)
    server = FedSPC(shared_keys=[WK, BN], num_partitions=3, corrected_keys=[WK],
                    learning_rate=ETA, learning_rates=etas)
    arrays = record({WK: f32(*START), BN: np.array([5], dtype=np.int64)})
    theta, u_bar = np.array(START, dtype=np.float64), np.zeros(2)
    for server_round, (plan, eta) in enumerate(zip(PLANS, etas), start=1):
        messages = list(server.configure_train(server_round, arrays, ConfigRecord(),
                                               FakeGrid(K_NODES)))
        assert {m.content.config_records["config"]["learning-rate"] for m in messages} \
            == {eta}
        arrays, _ = server.aggregate_train(server_round, [
            spc_reply(final, [bn], steps, node) for final, bn, steps, node in plan])
        changes = [-u_bar - (np.asarray(final) - theta) / (steps * eta)
                   for final, _, steps, _ in plan]
        u_bar = u_bar + sum(changes) / len(K_NODES)
        theta = np.mean([np.asarray(final) for final, *_ in plan], axis=0)
        np.testing.assert_allclose(server.global_reference[WK], u_bar, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(arrays_of(arrays)[WK], theta, rtol=1e-6)


def test_every_client_of_a_round_trains_with_that_rounds_eta(tmp_path):
    config = {"method": "fedrep", "fedspc": True, "num-rounds": 3, "local-epochs": 1,
              "batch-size": 64, "learning-rate": 0.05, "lr-schedule": "exponential",
              "lr-decay": 0.5, "checkpoint": False, "output-dir": str(tmp_path),
              "run-name": "decay"}
    grid = InProcessGrid(client_app.app, 3, config)
    assert run_server(grid, config) is None
    sent = {}
    for message in grid.sent:
        if message.metadata.message_type == "train":
            settings = message.content.config_records["config"]
            sent.setdefault(settings["server-round"], set()).add(settings["learning-rate"])
    assert sent == {1: {0.05}, 2: {0.025}, 3: {0.0125}}
    rounds = json.loads((tmp_path / "decay" / "metrics.json").read_text())["rounds"]
    assert all(math.isfinite(r["accuracy"]) for r in rounds)
