"""Robust aggregation rules and server optimizers on the shared block
(strategies.aggregation, strategies.server_optimizer), on hand-built replies."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvgM, FedYogi
from test_strategies import FakeGrid, arrays_of, f32, record, reply

from strategies import AggregationRule, FedSPC, PersonalizedFedAvg, ServerOptimizer
from strategies.aggregation import robust_reference_sum

pytestmark = pytest.mark.usefixtures("task_identity")
W, B, NBT = "w", "b", "bn.num_batches_tracked"


def updates_1d(*values) -> list[dict]:
    return [{W: f32(v)} for v in values]


# ------------------------------------------------------------ the rules by hand
def test_coordinate_rules_by_hand():
    arrays = [{W: f32(1.0, -4.0), NBT: np.array(n, dtype=np.int64)}
              for n in (1, 2, 3, 4, 10)]
    for a, v in zip(arrays, (1.0, 2.0, 3.0, 4.0, 100.0)):
        a[W][0] = v
    median = AggregationRule("median").combine(arrays, [1.0] * 5)
    assert median[W].tolist() == [3.0, -4.0] and median[W].dtype == np.float32
    assert median[NBT] == 4 and median[NBT].dtype == np.int64  # integers: the rounded mean
    # Trimming 20 % of 5 values cuts one at each end: mean of 2, 3, 4.
    trimmed = AggregationRule("trimmed-mean", trim_fraction=0.2).combine(arrays, [1.0] * 5)
    assert trimmed[W].tolist() == [3.0, -4.0]
    assert AggregationRule("trimmed-mean", trim_fraction=0.0).combine(
        arrays, [1.0] * 5)[W][0] == pytest.approx(22.0)  # no trim: the mean


def test_krum_and_multi_krum_by_hand():
    # Points 1, 2, 3.5, 4, 100 with f = 1: each is scored by its squared distances to
    # its n - f - 2 = 2 nearest: 7.25, 3.25, 2.5, 4.25, and ~1.9e4 for 100.
    updates = updates_1d(1.0, 2.0, 3.5, 4.0, 100.0)
    assert AggregationRule("krum", byzantine=1).selected(updates, [W]) == [2]
    multi = AggregationRule("multi-krum", byzantine=1, krum_select=3)
    assert multi.selected(updates, [W]) == [1, 2, 3]
    # Without krum-select, multi-krum averages the n - f best.
    assert AggregationRule("multi-krum", byzantine=1).selected(updates, [W]) == [0, 1, 2, 3]
    chosen = [updates[i] for i in multi.selected(updates, [W])]
    assert multi.combine(chosen, [1.0] * 3)[W][0] == pytest.approx((2.0 + 3.5 + 4.0) / 3)
    # The rules' other inputs are left alone: copies were scored.
    assert [u[W][0] for u in updates] == [1.0, 2.0, 3.5, 4.0, 100.0]


def test_rules_refuse_bad_parameters():
    for bad in ({"name": "mode"}, {"name": "trimmed-mean", "trim_fraction": 0.5},
                {"name": "krum", "byzantine": -1}):
        with pytest.raises(ValueError):
            AggregationRule(**bad)


def test_the_robust_reference_sum_is_the_count_times_the_centre():
    changes = updates_1d(1.0, 2.0, 9.0)
    total = robust_reference_sum(AggregationRule("median"), changes, [0, 1, 2], 3)
    assert total[W].tolist() == [6.0]  # 3 x median 2
    total = robust_reference_sum(AggregationRule("krum", byzantine=1), changes, [1], 3)
    assert total[W].tolist() == [6.0]  # 3 x the selected client's change


# ------------------------------------------------------- in the strategies
SHARED = {W: f32(0.0, 0.0), B: f32(0.0), NBT: np.array(0, dtype=np.int64)}


def honest_and_liar(liar_scale: float):
    """Four honest replies near (1, 1) and one far away (its partition 4)."""
    rng = np.random.default_rng(0)
    replies = []
    for node in range(1, 6):
        w = f32(*(1.0 + 0.1 * rng.standard_normal(2)))
        if node == 5:
            w = w * np.float32(liar_scale)
        replies.append(reply({W: w, B: f32(1.0), NBT: np.array(3, dtype=np.int64)},
                             node=node, **{"num-examples": 10, "shared-steps": 4}))
    return replies


def configured(server):
    server.configure_train(1, record(SHARED), ConfigRecord(), FakeGrid(range(1, 6)))
    return server


@pytest.mark.parametrize("rule", ["median", "trimmed-mean", "krum", "multi-krum"])
def test_a_robust_rule_holds_where_the_mean_moves(rule):
    kwargs = dict(shared_keys=list(SHARED), num_partitions=5, drift_keys=[W, B])
    mean = configured(PersonalizedFedAvg(**kwargs))
    robust = configured(PersonalizedFedAvg(aggregation=AggregationRule(
        rule, trim_fraction=0.2, byzantine=1), **kwargs))
    arrays, _ = mean.aggregate_train(1, honest_and_liar(50.0))
    assert np.abs(arrays_of(arrays)[W]).max() > 5  # the liar moved the mean
    arrays, metrics = robust.aggregate_train(1, honest_and_liar(50.0))
    assert np.abs(arrays_of(arrays)[W] - 1.0).max() < 0.3
    if rule in ("krum", "multi-krum"):
        assert 4 not in metrics["aggregated-client-ids"]
    assert arrays_of(arrays)[NBT] == 3


@pytest.mark.parametrize("rule", ["krum", "multi-krum"])
@pytest.mark.parametrize("shared", [{}, {NBT: np.array(3, dtype=np.int64)}])
def test_krum_with_nothing_trainable_shared_aggregates_every_reply(rule, shared):
    # Method "local" (nothing shared), or a split whose shared block holds buffers
    # only: Krum has nothing to score, every reply ties and enters the aggregate.
    strategy = PersonalizedFedAvg(shared_keys=list(shared), num_partitions=4, drift_keys=[],
                                  aggregation=AggregationRule(rule, byzantine=0))
    strategy.configure_train(1, record(shared), ConfigRecord(), FakeGrid([1, 2, 3, 4]))
    replies = [reply({k: np.array(n, dtype=np.int64) for k in shared}, node=n,
                     **{"num-examples": 5}) for n in range(1, 5)]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None and not strategy.report.failed
    assert metrics["aggregated-client-ids"] == [0, 1, 2, 3]
    assert arrays_of(arrays) == ({NBT: 2} if shared else {})  # rint(2.5): even
    assert AggregationRule(rule).selected([{}, {}, {}], []) == [0, 1, 2]


def test_fedspc_u_bar_follows_the_robust_rule():
    kwargs = dict(shared_keys=list(SHARED), num_partitions=5, corrected_keys=[W, B],
                  learning_rate=0.1)
    clean = configured(FedSPC(aggregation=AggregationRule("median"), **kwargs))
    clean.aggregate_train(1, honest_and_liar(1.0))
    attacked = configured(FedSPC(aggregation=AggregationRule("median"), **kwargs))
    attacked.aggregate_train(1, honest_and_liar(50.0))
    mean = configured(FedSPC(**kwargs))
    mean.aggregate_train(1, honest_and_liar(50.0))
    gap = np.abs(attacked.global_reference[W] - clean.global_reference[W]).max()
    assert gap < 0.1 * np.abs(clean.global_reference[W]).max()
    assert np.abs(mean.global_reference[W]).max() > 5 * np.abs(clean.global_reference[W]).max()
    # By hand: with the median, u_bar' = 0 + (1/5) * 5 * median_k(-Delta_k / (4 * 0.1)).
    deltas = np.stack([arrays_of(r.content.array_records["arrays"])[W]
                       for r in honest_and_liar(50.0)])
    np.testing.assert_allclose(attacked.global_reference[W],
                               np.median(-deltas / 0.4, axis=0), rtol=1e-6)


def test_a_reply_reporting_other_steps_or_images_than_its_partition_is_dropped():
    server = configured(PersonalizedFedAvg(
        shared_keys=list(SHARED), num_partitions=5,
        expected_counts={pid: (10, 4) for pid in range(5)}))
    replies = honest_and_liar(1.0)
    replies[1].content.metric_records["metrics"]["shared-steps"] = 1
    replies[2].content.metric_records["metrics"]["num-examples"] = 11
    _, metrics = server.aggregate_train(1, replies)
    assert metrics["clients"] == 3
    reasons = " | ".join(server.report.reasons)
    assert "'shared-steps' is 1; its data size and the config imply 4" in reasons
    assert "'num-examples' is 11, its partition holds 10 training images" in reasons


# ------------------------------------------------------------ server optimizers
def test_fedavgm_without_momentum_at_rate_one_is_the_mean_bit_for_bit():
    kwargs = dict(shared_keys=list(SHARED), num_partitions=5, drift_keys=[W, B])
    mean = configured(PersonalizedFedAvg(**kwargs))
    stepped = configured(PersonalizedFedAvg(
        server_optimizer=ServerOptimizer("fedavgm", [W, B], learning_rate=1.0), **kwargs))
    a, _ = mean.aggregate_train(1, honest_and_liar(1.0))
    b, _ = stepped.aggregate_train(1, honest_and_liar(1.0))
    for key in SHARED:
        assert arrays_of(a)[key].tobytes() == arrays_of(b)[key].tobytes()


FLOWER = {"fedavgm": (FedAvgM, dict(server_learning_rate=0.7, server_momentum=0.9)),
          "fedadam": (FedAdam, dict(eta=0.05, beta_1=0.9, beta_2=0.99, tau=1e-3)),
          "fedyogi": (FedYogi, dict(eta=0.05, beta_1=0.9, beta_2=0.99, tau=1e-3)),
          "fedadagrad": (FedAdagrad, dict(eta=0.05, tau=1e-3))}
OURS = {"fedavgm": dict(learning_rate=0.7, momentum=0.9),
        "fedadam": dict(learning_rate=0.05, tau=1e-3),
        "fedyogi": dict(learning_rate=0.05, tau=1e-3),
        "fedadagrad": dict(learning_rate=0.05, tau=1e-3)}


@pytest.mark.parametrize("name", sorted(FLOWER))
def test_the_shared_arrays_are_those_of_flowers_own_strategy_on_a_whole_model(name):
    # A whole model with no buffers: Flower's strategy (weighted by num-examples)
    # against ours (aggregation 'weighted') over three rounds of the same replies.
    start = {W: f32(0.5, -0.5), B: f32(0.25)}
    cls, options = FLOWER[name]
    flower = cls(**options)
    ours = PersonalizedFedAvg(shared_keys=[W, B], num_partitions=3, aggregation="weighted",
                              server_optimizer=ServerOptimizer(name, [W, B], **OURS[name]))
    rng = np.random.default_rng(1)
    theirs_now, ours_now = record(start), record(start)
    for server_round in (1, 2, 3):
        replies = [reply({W: f32(*rng.standard_normal(2)), B: f32(rng.standard_normal())},
                         node=n, **{"num-examples": 10 * n}) for n in (1, 2, 3)]
        list(flower.configure_train(server_round, theirs_now, ConfigRecord(),
                                    FakeGrid([1, 2, 3])))
        ours.configure_train(server_round, ours_now, ConfigRecord(), FakeGrid([1, 2, 3]))
        for message in replies:  # Flower's checks want replies to its own messages
            message.metadata.__dict__["_reply_to_message_id"] = "x"
        theirs_now, _ = flower.aggregate_train(server_round, replies)
        ours_now, _ = ours.aggregate_train(server_round, replies)
        for key in (W, B):
            np.testing.assert_allclose(arrays_of(ours_now)[key],
                                       arrays_of(theirs_now)[key].astype(np.float32),
                                       rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["fedavgm", "fedadam"])
def test_an_optimizer_restored_from_its_state_steps_as_the_original(name):
    current, rng = {W: f32(0.0, 1.0)}, np.random.default_rng(2)
    first = ServerOptimizer(name, [W], momentum=0.9)
    for server_round in (1, 2):
        current = first.step(server_round, current, {W: f32(*rng.standard_normal(2))})
    saved = first.state_arrays()
    assert saved and all("/" in key for key in saved)
    second = ServerOptimizer(name, [W], momentum=0.9)
    second.load_state_arrays(saved)
    target = {W: f32(3.0, -1.0)}
    assert (first.step(3, current, target)[W].tobytes()
            == second.step(3, current, target)[W].tobytes())
    with pytest.raises(ValueError, match="does not cover"):
        ServerOptimizer(name, [W, B]).load_state_arrays(saved)


def test_buffers_keep_the_aggregate_under_an_optimizer():
    out = ServerOptimizer("fedadam", [W]).step(
        1, {W: f32(0.0), NBT: np.array(1)}, {W: f32(1.0), NBT: np.array(5)})
    assert out[NBT] == 5 and out[W][0] != 1.0
