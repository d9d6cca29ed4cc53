"""FedSPC's ``fedspc-reference = "client-centre"`` (strategies/fedspc.py): the server
keeps every client's u_k and sets u_bar to the aggregation rule's centre of them.

The federation here is simulated by hand: client k has a true mean gradient G_k^t on
the one corrected parameter vector and takes E plain corrected steps, so its update is
Delta_k = -E eta (G_k^t - u_k + u_bar) and its own u_k becomes u_k - u_bar -
Delta_k / (E eta) (Algorithm 1, step 3). An attacker sends 50 times its update.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import ConfigRecord
from test_strategies import FakeGrid, arrays_of, f32, record, reply

from fedspc_app.core.config import RunConfig, validate
from fedspc_app.core.errors import ConfigError
from strategies import AggregationRule, FedSPC
from strategies.personalized import Privacy

pytestmark = pytest.mark.usefixtures("task_identity")
W = "w"
STEPS, ETA, CLIENTS = 4, 0.1, 5


def server(reference: str, rule: str = "mean", **kwargs) -> FedSPC:
    return FedSPC(shared_keys=[W], corrected_keys=[W], learning_rate=ETA,
                  num_partitions=CLIENTS, reference=reference, min_train_replies=0.1,
                  aggregation=AggregationRule(rule, trim_fraction=0.2), **kwargs)


class Federation:
    """CLIENTS simulated clients; ``attackers`` scale their update by 50."""

    def __init__(self, seed: int = 0, attackers: tuple[int, ...] = (), noise: float = 0.5):
        self.rng = np.random.default_rng(seed)
        self.base = self.rng.normal(0.0, 1.0, size=(CLIENTS, 2)).astype(np.float32)
        self.noise = noise
        self.attackers = attackers
        self.own = {k: f32(0.0, 0.0) for k in range(CLIENTS)}  # each client's own u_k

    def round(self, strategy: FedSPC, server_round: int, theta: np.ndarray,
              participants) -> np.ndarray:
        """One round through ``strategy``; the new theta_s."""
        strategy.configure_train(server_round, record({W: theta}), ConfigRecord(),
                                 FakeGrid(range(1, CLIENTS + 1)))
        u_bar = strategy.global_reference[W]
        replies = []
        for k in participants:
            gradient = self.base[k] + self.noise * self.rng.standard_normal(2)
            delta = (-STEPS * ETA * (gradient - self.own[k] + u_bar)).astype(np.float32)
            self.own[k] = (self.own[k] - u_bar - delta / np.float32(STEPS * ETA)).astype(
                np.float32)
            sent = delta * np.float32(50.0) if k in self.attackers else delta
            replies.append(reply({W: (theta + sent).astype(np.float32)}, node=k + 1,
                                 **{"num-examples": 10, "shared-steps": STEPS}))
        arrays, _ = strategy.aggregate_train(server_round, replies)
        return arrays_of(arrays)[W]


def run(reference: str, rule: str = "mean", rounds: int = 8, partial: bool = False,
        attackers: tuple[int, ...] = ()) -> tuple[FedSPC, Federation, list[np.ndarray]]:
    strategy, federation = server(reference, rule), Federation(attackers=attackers)
    theta, history = f32(0.0, 0.0), []
    for t in range(1, rounds + 1):
        participants = ([k for k in range(CLIENTS) if (k + t) % 2 == 0] if partial
                        else range(CLIENTS))
        theta = federation.round(strategy, t, theta, participants)
        history.append(strategy.global_reference[W].copy())
    return strategy, federation, history


@pytest.mark.parametrize("partial", [False, True])
def test_under_the_mean_the_client_centre_is_algorithm_one(partial):
    # The same clients (same draws), full or alternating partial participation:
    # u_bar from the tracked u_k equals Algorithm 1's increments, to float rounding.
    _, _, increment = run("increment", partial=partial)
    tracked, federation, centre = run("client-centre", partial=partial)
    for a, b in zip(increment, centre):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    assert np.abs(centre[-1]).max() > 0.1  # u_bar is not trivially zero
    # The server's u_k are the clients' own (a client not yet seen has u_k = 0).
    for k in range(CLIENTS):
        np.testing.assert_allclose(tracked.client_references[k][W], federation.own[k],
                                   rtol=1e-5, atol=1e-6)
    # And u_bar is their mean, by hand.
    np.testing.assert_allclose(centre[-1], np.mean(list(federation.own.values()), axis=0),
                               rtol=1e-5, atol=1e-6)


def test_the_median_of_the_u_k_by_hand():
    _, federation, history = run("client-centre", rule="median", rounds=3)
    own = np.stack(list(federation.own.values()))
    np.testing.assert_allclose(history[-1], np.median(own, axis=0), rtol=1e-6)


@pytest.mark.parametrize("rule", ["median", "trimmed-mean"])
def test_a_persistent_attackers_bias_accumulates_in_the_increment_not_in_the_centre(rule):
    # One attacker of five, 30 rounds. Under Algorithm 1's increment with a robust
    # rule, u_bar is the running sum of the rounds' robust centres of the changes;
    # the attacker shifts each a little, the same way, and u_bar walks off. The
    # robust centre of the u_k stays inside the honest clients' references.
    rounds, honest = 30, [1, 2, 3, 4]
    _, _, increment = run("increment", rule=rule, rounds=rounds, attackers=(0,))
    _, federation, centre = run("client-centre", rule=rule, rounds=rounds, attackers=(0,))
    own = np.stack([federation.own[k] for k in honest])
    assert np.all(centre[-1] >= own.min(axis=0) - 1e-6)
    assert np.all(centre[-1] <= own.max(axis=0) + 1e-6)
    spread = float(np.abs(own).max())
    assert np.linalg.norm(increment[-1]) > 2 * spread
    assert np.linalg.norm(increment[-1]) > 2 * np.linalg.norm(increment[9])  # still growing
    assert max(np.linalg.norm(u) for u in centre) < 2 * spread


def test_the_tracked_references_survive_a_checkpoint():
    strategy, federation, _ = run("client-centre", rule="median", rounds=3, partial=True)
    restored = server("client-centre", rule="median")
    state = strategy.state_arrays()
    assert {name for name in state if name.startswith("client/")} == {
        f"client/{k}/{W}" for k in strategy.client_references}
    restored.load_state_dict(strategy.state_dict(), 3, global_reference=state)
    assert set(state) == set(strategy.state_arrays())  # not consumed by the load
    np.testing.assert_array_equal(restored.global_reference[W], strategy.global_reference[W])
    assert set(restored.client_references) == set(strategy.client_references)
    # The next round is the same from the original and from the restored strategy.
    theta = f32(0.3, -0.2)
    twin = Federation()
    twin.rng, twin.own = np.random.default_rng(7), {k: v.copy() for k, v in federation.own.items()}
    federation.rng = np.random.default_rng(7)
    federation.round(strategy, 4, theta, range(CLIENTS))
    twin.round(restored, 4, theta, range(CLIENTS))
    np.testing.assert_array_equal(restored.global_reference[W], strategy.global_reference[W])


def test_a_checkpoint_without_tracked_references_is_refused():
    strategy, _, _ = run("increment", rounds=2)
    restored = server("client-centre")
    with pytest.raises(ValueError, match="keeps no u_k"):
        restored.load_state_dict(strategy.state_dict(), 2,
                                 global_reference=strategy.state_arrays())


@pytest.mark.parametrize("reference", ["client-centre", "server-centre", "auto"])
def test_a_centre_rule_run_whose_rounds_all_failed_resumes(reference):
    # Round 1 fails (no reply came): its checkpoint holds u_bar = 0 and no u_k, and a
    # resume continues it as the uninterrupted run goes on.
    strategy = server(reference, rule="median")
    strategy.configure_train(1, record({W: f32(0.0, 0.0)}), ConfigRecord(),
                             FakeGrid(range(1, CLIENTS + 1)))
    assert strategy.aggregate_train(1, []) == (None, None) and strategy.report.failed
    state = strategy.state_arrays()
    assert set(state) == {W}
    restored = server(reference, rule="median")
    restored.load_state_dict(strategy.state_dict(), 1, global_reference=state)
    np.testing.assert_array_equal(restored.global_reference[W], f32(0.0, 0.0))
    theta = f32(0.3, -0.2)
    for twin in (strategy, restored):
        Federation().round(twin, 2, theta, range(CLIENTS))
    np.testing.assert_array_equal(restored.global_reference[W], strategy.global_reference[W])
    assert set(restored.client_references) == set(range(CLIENTS))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="reference must be one of"):
        server("centre")
    with pytest.raises(ValueError, match="differential privacy"):
        server("client-centre", privacy=Privacy(1.0, 0.0, steps=STEPS))
    with pytest.raises(ConfigError, match="fedspc-reference"):
        validate(RunConfig(fedspc=True, fedspc_reference="median"))
    with pytest.raises(ConfigError, match="'fedspc-reference' = 'increment'"):
        validate(RunConfig(fedspc=True, fedspc_reference="client-centre",
                           dp_clipping_norm=1.0, local_steps=4))
    assert validate(RunConfig(fedspc=True, fedspc_reference="client-centre",
                              aggregation="median")).fedspc_reference == "client-centre"


@pytest.mark.parametrize("reference", ["client-centre", "server-centre"])
def test_a_centre_rule_under_the_weighted_mean_is_refused(reference):
    # The centre counts every client's u_k alike: under "weighted" u_bar would not be
    # the weighted mean of the u_k that theta_s's correction needs.
    with pytest.raises(ConfigError, match="weighs every u_k alike"):
        validate(RunConfig(fedspc=True, fedspc_reference=reference, aggregation="weighted"))
    with pytest.raises(ValueError, match="needs 'increment'"):
        server(reference, rule="weighted")
    assert validate(RunConfig(fedspc=True, aggregation="weighted")).reference_rule == "increment"


@pytest.mark.parametrize(("aggregation", "fedspc", "warned"), [
    ("krum", True, True), ("krum", False, False), ("median", True, False)])
def test_krum_with_fedspc_is_warned_about(aggregation, fedspc, warned):
    from fedspc_app.core.config import parse_run_config
    from fedspc_app.core.methods import get_method
    from fedspc_app.data import run_data
    from fedspc_app.models.split import parameter_split
    from fedspc_app.server_app import build_strategy, make_model

    config = parse_run_config({"method": "fedrep", "fedspc": fedspc,
                               "aggregation": aggregation, "byzantine-clients": 1})
    split = parameter_split(make_model(config, run_data.KNOWN_SHAPES["digits"]),
                            get_method("fedrep"))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("flwr")
    logger.addHandler(handler)
    try:
        strategy = build_strategy(config, get_method("fedrep"), split, 5)
    finally:
        logger.removeHandler(handler)
    assert isinstance(strategy, FedSPC) == fedspc
    said = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert any("'krum' with FedSPC" in m and "31.89 %" in m for m in said) == warned
