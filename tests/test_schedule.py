"""The clients' learning rate over rounds (lr-schedule): the η sequence, its use in
Algorithm 1, and the messages that carry it."""

from __future__ import annotations

import itertools
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
    cosine = 0.01 + (0.1 - 0.01) * (1 + np.cos(np.pi * t / 7)) / 2
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


@pytest.mark.parametrize("rounds", [1, 2, 5, 100])
def test_no_schedule_gives_a_training_round_eta_zero(rounds):
    """The cosine schedule with the default lr-min = 0 used to reach η = 0 in the last
    round, where FedSPC divides by E·η."""
    for schedule in ("constant", "exponential", "cosine", "step"):
        etas = rates(**{"lr-schedule": schedule, "num-rounds": rounds, "lr-decay": 0.5,
                        "lr-step-rounds": 2})
        assert len(etas) == rounds and all(math.isfinite(e) and e > 0 for e in etas)
        assert etas[0] == 0.1
        assert all(later <= earlier for earlier, later in itertools.pairwise(etas))


def test_a_schedule_that_underflows_is_refused_with_its_round(tmp_path):
    """Round 20's eta is about 1e-39: below the 2.9e-39 whose inverse float32 still
    holds (round 3 of a 1e-20 decay made every u_k NaN), long before eta reaches 0.0."""
    with pytest.raises(ConfigError, match=r"gives round 20 a learning rate of 1\.0\d*e-39"):
        rates(**{"num-rounds": 300, "lr-schedule": "exponential", "lr-decay": 0.01})
    config = {"num-rounds": 300, "lr-schedule": "exponential", "lr-decay": 0.01,
              "output-dir": str(tmp_path), "run-name": "underflow"}
    stop = run_server(InProcessGrid(client_app.app, 2, config), config)
    assert stop is not None and "gives round 20 a learning rate of" in stop
    assert not (tmp_path / "underflow" / "metrics.json").exists()


@pytest.mark.parametrize("schedule", ["constant", "exponential", "cosine", "step"])
def test_every_schedule_over_its_full_length_with_fedspc(tmp_path, schedule):
    """Every client of every round trains with the round's η, the server divides by the
    same η, and the run ends (the last round too)."""
    config = {"method": "fedrep", "fedspc": True, "num-rounds": 3, "local-epochs": 1,
              "batch-size": 64, "learning-rate": 0.05, "lr-schedule": schedule,
              "lr-decay": 0.5, "lr-step-rounds": 2, "checkpoint": False,
              "output-dir": str(tmp_path), "run-name": schedule}
    expected = round_learning_rates(parse_run_config(config))
    grid = InProcessGrid(client_app.app, 3, config)
    assert run_server(grid, config) is None
    sent = {}
    for message in grid.sent:
        if message.metadata.message_type == "train":
            settings = message.content.config_records["config"]
            sent.setdefault(settings["server-round"], set()).add(settings.get("learning-rate"))
    if schedule == "constant":  # the run-config's η, not sent
        assert sent == {1: {None}, 2: {None}, 3: {None}}
    else:
        assert sent == {r: {eta} for r, eta in enumerate(expected, start=1)}
        assert all(eta > 0 for eta in expected)
    assert not [r for r in grid.replies if r.has_error()]
    rounds = json.loads((tmp_path / schedule / "metrics.json").read_text())["rounds"]
    assert len(rounds) == 3 and all(math.isfinite(r["accuracy"]) for r in rounds)
    if schedule != "constant":
        assert [r["learning-rate"] for r in rounds] == list(expected)


class ZeroRateGrid(InProcessGrid):
    """Sends node 1 a round η of 0 in round 2 (as a faulty server would)."""

    def deliver(self, message):
        settings = message.content.config_records.get("config")
        if (message.metadata.dst_node_id == 1 and settings is not None
                and settings.get("server-round") == 2
                and message.metadata.message_type == "train"):
            settings["learning-rate"] = 0.0
        return super().deliver(message)


def test_a_client_refuses_a_rounds_eta_that_is_not_positive(tmp_path):
    """Training at the base η while the server divides by another would corrupt u_bar:
    the client replies with an error instead, and the server drops that reply."""
    config = {"method": "fedrep", "fedspc": True, "num-rounds": 2, "local-epochs": 1,
              "batch-size": 64, "learning-rate": 0.05, "lr-schedule": "exponential",
              "lr-decay": 0.5, "checkpoint": False, "output-dir": str(tmp_path),
              "run-name": "zero"}
    grid = ZeroRateGrid(client_app.app, 3, config)
    assert run_server(grid, config) is None
    errors = [r for r in grid.replies if r.has_error()]
    assert len(errors) == 1 and "learning-rate" in errors[0].error.reason
    rounds = json.loads((tmp_path / "zero" / "metrics.json").read_text())["rounds"]
    assert rounds[1]["train-clients"] == 2
