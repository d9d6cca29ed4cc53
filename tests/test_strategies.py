"""Tests of the server strategies (strategies.personalized, strategies.fedspc).

Replies are hand-built Flower Messages fed straight into ``aggregate_train`` /
``aggregate_evaluate``; ``configure_train`` gets a tiny fake grid.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from strategies import FedSPC, PersonalizedFedAvg, mean_arrays

W = "body.weight"
B = "body.bias"
NBT = "bn.num_batches_tracked"
_ids = itertools.count(1)


# ------------------------------------------------------------------ helpers
pytestmark = pytest.mark.usefixtures("task_identity")


class FakeGrid:
    """Just enough of a Grid for ``configure_train``: the connected node ids; node n
    holds partition n - 1 (or ``partitions[n]``) and says so when asked."""

    def __init__(self, node_ids, partitions=None):
        self.node_ids = list(node_ids)
        self.partitions = partitions or {node: node - 1 for node in self.node_ids}

    def get_node_ids(self):
        return list(self.node_ids)

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = f"q{message.metadata.dst_node_id}"
            replies.append(Message(RecordDict({"metrics": MetricRecord(
                {"partition-id": self.partitions[message.metadata.dst_node_id]})}),
                reply_to=message))
        return replies


def record(arrays: dict) -> ArrayRecord:
    return ArrayRecord({key: Array(np.asarray(value)) for key, value in arrays.items()})


def arrays_of(rec: ArrayRecord) -> dict:
    return {key: array.numpy() for key, array in rec.items()}


def instruction(node: int) -> Message:
    """A train instruction to ``node`` with a message id (so it can be replied to)."""
    message = Message(content=RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
    message.metadata.__dict__["_message_id"] = f"m{next(_ids)}"
    return message


def from_node(message: Message, node: int) -> Message:
    """``message`` as the reply of ``node`` (the source a SuperLink would set)."""
    message.metadata.__dict__["_src_node_id"] = node
    return message


def reply(arrays: dict, node: int = 1, extra_records: dict | None = None,
          **metrics) -> Message:
    """A train reply of ``node`` carrying ``arrays`` and the MetricRecord ``metrics``
    (partition ``node - 1`` unless given)."""
    metrics.setdefault("partition-id", node - 1)
    content = RecordDict({"arrays": record(arrays), "metrics": MetricRecord(metrics)})
    for key, value in (extra_records or {}).items():
        content[key] = value
    return from_node(Message(content=content, dst_node_id=0,
                             message_type=MessageType.TRAIN), node)


def bound(server, nodes=range(1, 11)):
    """``server`` with each node n bound to partition n - 1 (as its answer to the
    partition query before round 1 would bind it)."""
    for node in nodes:
        assert server.sampler.bind(node, node - 1) is None
    return server


def error_reply(node: int = 9, reason: str = "boom") -> Message:
    return Message(Error(code=0, reason=reason), reply_to=instruction(node))


def eval_reply(partition_id: int, correct: int, n: int, loss_sum: float,
               node: int = 1, **extra) -> Message:
    metrics = MetricRecord({"partition-id": partition_id, "correct": correct,
                            "num-examples": n, "loss-sum": loss_sum, **extra})
    return from_node(Message(content=RecordDict({"metrics": metrics}), dst_node_id=0,
                             message_type=MessageType.EVALUATE), node)


def f32(*values) -> np.ndarray:
    return np.array(values, dtype=np.float32)


SHARED = {W: f32(1.0, 2.0, 3.0), B: f32(0.5), NBT: np.array(4, dtype=np.int64)}


def strategy(**kwargs) -> PersonalizedFedAvg:
    """A PersonalizedFedAvg whose broadcast is SHARED (set through configure_train)."""
    result = PersonalizedFedAvg(shared_keys=list(SHARED), num_partitions=10, **kwargs)
    result.configure_train(1, record(SHARED), ConfigRecord(), FakeGrid([1, 2]))
    return result


GOOD_A = {W: f32(1.0, 2.0, 3.0), B: f32(1.0), NBT: np.array(10, dtype=np.int64)}
GOOD_B = {W: f32(3.0, 4.0, 7.0), B: f32(2.0), NBT: np.array(14, dtype=np.int64)}


# ========================================================= PersonalizedFedAvg

def assert_mean_of_the_good_pair(arrays, metrics) -> None:
    """The aggregate of GOOD_A and GOOD_B (10 and 30 examples): their plain mean."""
    out = arrays_of(arrays)
    assert set(out) == set(SHARED)
    np.testing.assert_allclose(out[W], [2.0, 3.0, 5.0])
    np.testing.assert_allclose(out[B], [1.5])
    assert out[NBT] == 12
    assert metrics["clients"] == 2
    assert metrics["num-examples"] == 40

def test_unweighted_mean_is_the_default():
    # Prepare
    server = strategy()
    replies = [reply(GOOD_A, node=1, **{"num-examples": 10, "train-loss": 1.0}),
               reply(GOOD_B, node=2, **{"num-examples": 30, "train-loss": 3.0})]

    # Execute
    arrays, metrics = server.aggregate_train(1, replies)

    # Assert: (a + b) / 2, whatever the sample counts
    assert_mean_of_the_good_pair(arrays, metrics)
    assert metrics["train-loss"] == pytest.approx(2.0)


def test_train_metrics_carry_the_drift_diagnostics_by_hand():
    server = strategy()  # broadcast SHARED; drift over the float keys W and B
    _, metrics = server.aggregate_train(1, [
        reply(GOOD_A, node=1, **{"num-examples": 10}),
        reply(GOOD_B, node=2, **{"num-examples": 30})])
    # Delta_A = (0, 0, 0 | 0.5), Delta_B = (2, 2, 4 | 1.5), m = (1, 1, 2 | 1)
    assert metrics["update-norm"] == pytest.approx(7 ** 0.5)
    assert metrics["client-update-norm"] == pytest.approx((0.5 + 26.25 ** 0.5) / 2)
    assert metrics["drift-dispersion"] == pytest.approx(6.25 / 7)
    assert list(metrics["train-client-ids"]) == [0, 1]


def test_weighted_mean_uses_num_examples():
    # Prepare
    server = strategy(aggregation="weighted")
    replies = [reply(GOOD_A, node=1, **{"num-examples": 10}),
               reply(GOOD_B, node=2, **{"num-examples": 30})]

    # Execute
    out = arrays_of(server.aggregate_train(1, replies)[0])

    # Assert: (10 a + 30 b) / 40
    np.testing.assert_allclose(out[W], [(10 * 1 + 30 * 3) / 40, (10 * 2 + 30 * 4) / 40,
                                        (10 * 3 + 30 * 7) / 40], rtol=1e-6)
    np.testing.assert_allclose(out[B], [(10 * 1 + 30 * 2) / 40], rtol=1e-6)
    assert out[NBT] == (10 * 10 + 30 * 14) / 40  # = 13


def test_unknown_aggregation_is_rejected():
    with pytest.raises(ValueError, match="aggregation"):
        PersonalizedFedAvg(shared_keys=[W], aggregation="mode")


def test_mean_arrays_keeps_dtypes_and_rounds_integers():
    # Prepare
    updates = [
        {"f": f32(0.1, 1.0), "i": np.array([1, 1], dtype=np.int64)},
        {"f": f32(0.2, 2.0), "i": np.array([1, 2], dtype=np.int64)},
        {"f": f32(0.4, 4.0), "i": np.array([2, 2], dtype=np.int64)},
    ]

    # Execute
    out = mean_arrays(updates, [1.0, 1.0, 1.0])

    # Assert: means 4/3 -> 1 and 5/3 -> 2 (rounded, not truncated)
    assert out["f"].dtype == np.float32
    assert out["i"].dtype == np.int64
    np.testing.assert_array_equal(out["i"], [1, 2])
    np.testing.assert_allclose(out["f"], [0.7 / 3, 7.0 / 3], rtol=1e-6)


def test_mean_arrays_is_the_whole_array_formula_bit_for_bit():
    """Accumulated a chunk at a time, the mean is still sum_k float64(x_k) * (w_k / W)
    in the updates' order, to the last bit (keys longer than a chunk, 0-d, integer)."""
    from strategies import aggregation

    rng = np.random.default_rng(7)
    shapes = {"big": (2, aggregation.CHUNK + 5), "scalar": (), "small": (7,)}
    for trial in range(5):
        updates = [{**{k: (rng.standard_normal(s) * 10.0 ** rng.integers(-4, 4))
                       .astype(np.float32) for k, s in shapes.items()},
                    NBT: np.array(rng.integers(0, 100), dtype=np.int64)}
                   for _ in range(int(rng.integers(1, 9)))]
        weights = list(rng.uniform(0.1, 50.0, len(updates)))
        total = float(sum(weights))
        out = mean_arrays(updates, weights)
        for key, first in updates[0].items():
            acc = np.zeros(np.shape(first), dtype=np.float64)
            for update, weight in zip(updates, weights):
                acc += np.asarray(update[key], dtype=np.float64) * (weight / total)
            expected = (np.rint(acc).astype(first.dtype)
                        if np.issubdtype(first.dtype, np.integer) else acc.astype(first.dtype))
            assert out[key].dtype == expected.dtype and out[key].shape == expected.shape
            assert out[key].tobytes() == expected.tobytes(), (trial, key)


def test_aggregate_train_keeps_dtypes():
    server = strategy()
    replies = [reply(GOOD_A, node=1, **{"num-examples": 1}),
               reply(GOOD_B, node=2, **{"num-examples": 1})]
    out = arrays_of(server.aggregate_train(1, replies)[0])
    assert out[W].dtype == np.float32
    assert out[B].dtype == np.float32
    assert out[NBT].dtype == np.int64


def test_aggregate_train_keeps_shapes_including_0d_buffers():
    """BatchNorm's num_batches_tracked is a 0-d tensor; it must stay 0-d.

    Otherwise the next broadcast has shape (1,), every client reply (shape ())
    is rejected by check_reply, and clients cannot load the broadcast either.
    """
    # Prepare
    server = strategy()
    replies = [reply(GOOD_A, node=1, **{"num-examples": 1}),
               reply(GOOD_B, node=2, **{"num-examples": 1})]

    # Execute
    arrays, _ = server.aggregate_train(1, replies)

    # Assert
    out = arrays_of(arrays)
    assert {key: value.shape for key, value in out.items()} == {
        key: value.shape for key, value in SHARED.items()}


def test_aggregated_arrays_can_be_broadcast_next_round():
    # Prepare: round 1 aggregated into the round-2 broadcast
    server = strategy()
    arrays, _ = server.aggregate_train(1, [reply(GOOD_A, node=1, **{"num-examples": 1})])
    server.configure_train(2, arrays, ConfigRecord(), FakeGrid([1, 2]))

    # Execute / Assert: a reply shaped like the model's state dict is accepted
    assert server.check_reply(reply(GOOD_B, node=2, **{"num-examples": 1})) is None


def _bad_replies() -> dict:
    personal = dict(GOOD_B, **{"head.weight": f32(9.0)})
    missing = {k: v for k, v in GOOD_B.items() if k != B}
    wrong_shape = dict(GOOD_B, **{W: f32(1.0, 2.0)})
    nan = dict(GOOD_B, **{W: f32(1.0, np.nan, 3.0)})
    inf = dict(GOOD_B, **{B: f32(np.inf)})
    return {
        "personal-key": (reply(personal, node=3, **{"num-examples": 5}), "head.weight"),
        "missing-key": (reply(missing, node=3, **{"num-examples": 5}), B),
        "wrong-shape": (reply(wrong_shape, node=3, **{"num-examples": 5}), "shape"),
        "nan": (reply(nan, node=3, **{"num-examples": 5}), "non-finite"),
        "inf": (reply(inf, node=3, **{"num-examples": 5}), "non-finite"),
        "no-num-examples": (reply(GOOD_B, node=3, **{"train-loss": 1.0}), "num-examples"),
        "zero-num-examples": (reply(GOOD_B, node=3, **{"num-examples": 0}), "num-examples"),
        "float-num-examples": (reply(GOOD_B, node=3, **{"num-examples": 5.0}),
                               "num-examples"),
        "error": (error_reply(node=3, reason="boom"), "boom"),
    }


BAD_KINDS = [
    "personal-key", "missing-key", "wrong-shape", "nan", "inf", "no-num-examples",
    "zero-num-examples", "float-num-examples", "error",
]


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_reply_is_dropped_and_the_others_aggregated(kind):
    # Prepare: two good replies and one bad one
    server = strategy()
    bad, _ = _bad_replies()[kind]
    replies = [reply(GOOD_A, node=1, **{"num-examples": 10}), bad,
               reply(GOOD_B, node=2, **{"num-examples": 30})]

    # Execute
    arrays, metrics = server.aggregate_train(1, replies)

    # Assert: the result is the mean of the two good ones only
    assert_mean_of_the_good_pair(arrays, metrics)


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_check_reply_gives_a_reason(kind):
    server = strategy()
    bad, needle = _bad_replies()[kind]
    reason = server.check_reply(bad)
    assert reason is not None and needle in reason
    assert server.check_reply(reply(GOOD_A, **{"num-examples": 1})) is None


def test_a_round_without_a_usable_reply_fails_with_its_reasons():
    # Prepare
    server = strategy()
    bad = _bad_replies()
    replies = [bad["error"][0], bad["nan"][0], bad["personal-key"][0]]

    # Execute
    arrays, metrics = server.aggregate_train(4, replies)

    # Assert: no aggregate, and why
    assert arrays is None and metrics is None
    report = server.report
    assert report.failed and report.server_round == 4
    assert (report.sampled, report.accepted, report.dropped) == (3, 0, 3)
    reasons = " | ".join(report.reasons)
    assert "boom" in reasons and "non-finite" in reasons and "head.weight" in reasons


def test_no_replies_at_all_fail_the_round():
    server = strategy()  # two nodes were sampled
    assert server.aggregate_train(1, []) == (None, None)
    assert server.report.failed
    assert "2 sampled client(s) did not reply" in server.report.reasons[-1]


@pytest.mark.parametrize("good,needed_fraction,fails", [
    (1, 0.5, True), (2, 0.5, False), (1, 0.33, False), (1, 0.34, True), (2, 1.0, True),
])
def test_min_train_replies_is_a_fraction_of_the_sampled_clients(good, needed_fraction,
                                                                 fails):
    # Prepare: 3 sampled clients (K = 4, fraction 0.75), `good` usable replies
    server = PersonalizedFedAvg(shared_keys=list(SHARED), num_partitions=4,
                                fraction_train=0.75, min_train_replies=needed_fraction)
    messages = list(server.configure_train(1, record(SHARED), ConfigRecord(),
                                           FakeGrid([1, 2, 3, 4])))
    assert len(messages) == 3
    replies = [reply(GOOD_A, node=n, **{"num-examples": 5}) for n in range(1, good + 1)]
    replies += [error_reply(node=9)] * (3 - good)

    # Execute
    arrays, _ = server.aggregate_train(1, replies)

    # Assert: ceil(fraction * 3) usable replies needed
    assert (arrays is None) == fails == server.report.failed


def test_accepted_replies_are_what_the_next_messages_tell_the_clients():
    server = strategy()
    server.aggregate_train(3, [reply(GOOD_A, node=1, **{"num-examples": 5}),
                               reply(GOOD_B, node=3, **{"num-examples": 5,
                                                        "partition-id": 99})])
    decisions = server.decisions()
    assert decisions["accepted-rounds"][:3] == [3, 0, 0]  # partition 99 is not a client
    messages = list(server.configure_evaluate(3, record(SHARED), ConfigRecord(),
                                              FakeGrid([1, 2])))
    assert list(messages[0].content.config_records["config"]["accepted-rounds"])[:3] == \
        [3, 0, 0]


def test_a_second_reply_of_one_node_is_dropped():
    server = strategy()
    _, metrics = server.aggregate_train(1, [
        reply(GOOD_A, node=1, **{"num-examples": 5}),
        reply(GOOD_B, node=1, **{"num-examples": 5})])
    assert metrics["clients"] == 1
    assert "a second reply for partition 0" in server.report.reasons[0]


@pytest.mark.parametrize("liar_first", [True, False], ids=["liar-first", "liar-last"])
def test_a_node_cannot_reply_for_another_nodes_partition(liar_first):
    # Node 4 holds partition 3 and node 9 partition 8 (their answers before round 1);
    # node 9 claims partition 3, before or after node 4's reply.
    server = PersonalizedFedAvg(shared_keys=list(SHARED), num_partitions=10)
    server.configure_train(1, record(SHARED), ConfigRecord(), FakeGrid(range(1, 11)))
    honest = reply(GOOD_A, node=4, **{"num-examples": 5})
    liar = reply(GOOD_B, node=9, **{"num-examples": 5, "partition-id": 3})
    replies = [liar, honest] if liar_first else [honest, liar]

    arrays, metrics = server.aggregate_train(1, replies)

    assert metrics["clients"] == 1 and list(metrics["train-client-ids"]) == [3]
    np.testing.assert_array_equal(arrays_of(arrays)[W], GOOD_A[W])  # the honest reply
    assert server.report.reasons[0] == \
        "node 9: node 9 is bound to partition 8, its reply claims 3"
    assert server.accepted_rounds[3] == 1 and server.accepted_rounds[8] == 0
    # ... and its evaluation reply likewise.
    result = server.aggregate_evaluate(1, [eval_reply(3, 9, 10, 1.0, node=9),
                                           eval_reply(3, 5, 10, 1.0, node=4)])
    assert result["clients"] == 1 and result["accuracy"] == pytest.approx(0.5)
    assert server.report.evaluate_dropped == 1


def test_a_node_bound_to_no_partition_is_not_heard():
    server = strategy()  # nodes 1 and 2 are bound
    assert "node 7 is bound to no partition" in server.check_reply(
        reply(GOOD_A, node=7, **{"num-examples": 5}))


def test_aggregates_do_not_depend_on_the_order_replies_arrive_in():
    """Float sums depend on their order; replies are summed in partition order, so the
    same seed gives bit-identical runs however the replies arrive."""
    rng = np.random.default_rng(0)
    n = 6
    values = [(rng.standard_normal(64) * 10.0 ** rng.integers(-6, 6)).astype(np.float32)
              for _ in range(n)]
    finals = [{WK: v, BN: np.array(1, dtype=np.int64)} for v in values]

    def play(order):
        server = fedspc(num_partitions=n)
        server.configure_train(1, record({WK: np.zeros(64, np.float32),
                                          BN: np.array(0, dtype=np.int64)}),
                               ConfigRecord(), FakeGrid(list(range(1, n + 1))))
        replies = [reply(finals[i], node=int(i) + 1, **{"num-examples": 10 + int(i),
                                                   "shared-steps": 3}) for i in order]
        arrays, _ = server.aggregate_train(1, replies)
        return arrays_of(arrays)[WK], server.global_reference[WK]

    reference = play(range(n))
    for seed in range(5):
        order = np.random.default_rng(seed).permutation(n)
        theta, u_bar = play(order)
        assert theta.tobytes() == reference[0].tobytes(), order
        assert u_bar.tobytes() == reference[1].tobytes(), order


@pytest.mark.parametrize(
    "arrays",
    [
        dict(SHARED, **{"head.weight": f32(1.0)}),  # a personal key too
        {W: SHARED[W], NBT: SHARED[NBT]},  # a shared key missing
    ],
    ids=["extra-key", "missing-key"],
)
def test_configure_train_refuses_arrays_other_than_the_shared_keys(arrays):
    server = PersonalizedFedAvg(shared_keys=list(SHARED))
    with pytest.raises(ValueError, match="shared keys"):
        server.configure_train(1, record(arrays), ConfigRecord(), FakeGrid([1, 2, 3]))


def test_configure_train_messages_carry_only_the_shared_keys():
    # Prepare
    server = PersonalizedFedAvg(shared_keys=list(SHARED), num_partitions=3)
    grid = FakeGrid([11, 12, 13], {11: 0, 12: 1, 13: 2})

    # Execute
    messages = list(server.configure_train(2, record(SHARED), ConfigRecord({"lr": 0.1}),
                                           grid))

    # Assert
    assert sorted(m.metadata.dst_node_id for m in messages) == [11, 12, 13]
    for message in messages:
        assert message.metadata.message_type == MessageType.TRAIN
        assert list(message.content.array_records) == ["arrays"]
        sent = arrays_of(message.content.array_records["arrays"])
        assert set(sent) == set(SHARED)
        for key, value in SHARED.items():
            np.testing.assert_array_equal(sent[key], value)
        assert message.content.config_records["config"]["server-round"] == 2
    assert set(server.broadcast) == set(SHARED)


def test_aggregate_evaluate_personalized_and_weighted_accuracy():
    # Prepare: partition ids out of order, very different test-set sizes
    server = bound(PersonalizedFedAvg(shared_keys=[W], num_partitions=3), [1, 2, 3])
    replies = [
        eval_reply(partition_id=2, correct=9, n=10, loss_sum=3.0, node=3),
        error_reply(node=7, reason="eval broke"),
        eval_reply(partition_id=0, correct=1, n=4, loss_sum=8.0, node=1),
        eval_reply(partition_id=1, correct=30, n=40, loss_sum=16.0, node=2),
    ]

    # Execute
    result = server.aggregate_evaluate(5, replies)

    # Assert
    assert result["accuracy"] == pytest.approx((0.25 + 0.75 + 0.9) / 3)
    assert result["weighted-accuracy"] == pytest.approx(40 / 54)
    assert result["loss"] == pytest.approx(27.0 / 54)
    assert result["clients"] == 3
    assert list(result["client-ids"]) == [0, 1, 2]
    assert list(result["client-accuracy"]) == pytest.approx([0.25, 0.75, 0.9])
    assert list(result["client-examples"]) == [4, 40, 10]


@pytest.mark.parametrize("metrics,reason", [
    ({"num-examples": 10, "loss-sum": 1.0, "partition-id": 0}, "missing correct"),
    ({"num-examples": 10, "correct": 11, "loss-sum": 1.0, "partition-id": 0}, "'correct'"),
    ({"num-examples": 10, "correct": 5, "loss-sum": float("nan"), "partition-id": 0},
     "'loss-sum'"),
    ({"num-examples": 0, "correct": 0, "loss-sum": 1.0, "partition-id": 0},
     "'num-examples'"),
    ({"num-examples": 10, "correct": 5, "loss-sum": 1.0, "partition-id": 17},
     "'partition-id'"),
])
def test_a_bad_evaluation_reply_is_dropped_and_counted(metrics, reason):
    server = strategy()
    server.aggregate_train(2, [reply(GOOD_A, node=1, **{"num-examples": 5})])
    bad = Message(content=RecordDict({"metrics": MetricRecord(metrics)}), dst_node_id=2,
                  message_type=MessageType.EVALUATE)
    assert reason in server.check_evaluation(bad)
    result = server.aggregate_evaluate(2, [eval_reply(1, 5, 10, 2.0, node=2), bad])
    assert result["clients"] == 1 and result["accuracy"] == pytest.approx(0.5)
    assert server.report.evaluate_dropped == 1


def test_the_global_model_accuracy_is_averaged_per_client_in_partition_order():
    server = bound(PersonalizedFedAvg(shared_keys=[W], num_partitions=3), [1, 2, 3])
    replies = [eval_reply(2, 9, 10, 3.0, node=3, **{"global-correct": 2, "global-examples": 10}),
               eval_reply(0, 1, 4, 8.0, node=1, **{"global-correct": 3, "global-examples": 4}),
               eval_reply(1, 30, 40, 16.0, node=2, **{"global-correct": 10, "global-examples": 40})]
    result = server.aggregate_evaluate(5, replies)
    assert list(result["client-global-accuracy"]) == pytest.approx([0.75, 0.25, 0.2])
    assert result["global-accuracy"] == pytest.approx((0.75 + 0.25 + 0.2) / 3)
    assert result["accuracy"] == pytest.approx((0.25 + 0.75 + 0.9) / 3)  # the personal models


def test_the_global_model_accuracy_needs_every_client():
    server = bound(PersonalizedFedAvg(shared_keys=[W], num_partitions=2), [1, 2])
    replies = [eval_reply(0, 5, 10, 2.0, node=1, **{"global-correct": 4, "global-examples": 10}),
               eval_reply(1, 5, 10, 2.0, node=2)]  # one client does not report it
    result = server.aggregate_evaluate(1, replies)
    assert result["clients"] == 2
    assert "global-accuracy" not in result and "client-global-accuracy" not in result


@pytest.mark.parametrize("extra", [
    {"global-correct": 11, "global-examples": 10},
    {"global-correct": 1.5, "global-examples": 10},
    {"global-correct": 0, "global-examples": 0},
    {"global-examples": 10},  # a count without its pair
])
def test_a_reply_with_invalid_global_model_counts_is_dropped(extra):
    server = bound(PersonalizedFedAvg(shared_keys=[W], num_partitions=2), [1, 2])
    bad = eval_reply(1, 5, 10, 2.0, node=2, **extra)
    assert "'global-" in server.check_evaluation(bad)
    result = server.aggregate_evaluate(1, [
        eval_reply(0, 5, 10, 2.0, node=1, **{"global-correct": 4, "global-examples": 10}), bad])
    assert result["clients"] == 1 and result["global-accuracy"] == pytest.approx(0.4)


def test_aggregate_evaluate_with_only_errors_returns_none():
    server = PersonalizedFedAvg(shared_keys=[W])
    assert server.aggregate_evaluate(1, [error_reply(), error_reply()]) is None


# ===================================================================== FedSPC
WK = "body.weight"  # shared and corrected
BN = "body.bn.num_batches_tracked"  # shared, averaged, not corrected
ETA = 0.1


def fedspc(upload: str = "derived", fraction_train: float = 1.0,
           num_partitions: int = 3) -> FedSPC:
    return FedSPC(shared_keys=[WK, BN], fraction_train=fraction_train,
                  num_partitions=num_partitions, corrected_keys=[WK], learning_rate=ETA,
                  upload=upload)


def spc_reply(final_w, bn: int, steps: int | None, node: int,
              change: dict | None = None) -> Message:
    metrics = {"num-examples": 20, "train-loss": 1.0}
    if steps is not None:
        metrics["shared-steps"] = steps
    extra = {"reference-change": record(change)} if change is not None else None
    return reply({WK: np.asarray(final_w, dtype=np.float32),
                  BN: np.array(bn, dtype=np.int64)}, node=node, extra_records=extra,
                 **metrics)


def test_corrected_keys_outside_the_shared_keys_are_rejected():
    with pytest.raises(ValueError, match="head.weight"):
        FedSPC(shared_keys=[WK, BN], corrected_keys=[WK, "head.weight"], learning_rate=ETA)


def test_unknown_upload_mode_is_rejected():
    with pytest.raises(ValueError, match="upload"):
        FedSPC(shared_keys=[WK, BN], corrected_keys=[WK], learning_rate=ETA, upload="both")


@pytest.mark.parametrize("upload", ["derived", "explicit"])
def test_configure_train_adds_zero_global_reference_and_upload_mode(upload):
    # Prepare
    server = fedspc(upload)
    theta = {WK: f32(1.0, -2.0), BN: np.array(10, dtype=np.int64)}

    # Execute
    messages = list(server.configure_train(1, record(theta), ConfigRecord(),
                                           FakeGrid([1, 2, 3])))

    # Assert
    assert len(messages) == 3
    for message in messages:
        reference = arrays_of(message.content.array_records["global-reference"])
        assert set(reference) == {WK}  # exactly the corrected keys, not BN
        assert reference[WK].dtype == np.float32
        np.testing.assert_array_equal(reference[WK], [0.0, 0.0])
        assert set(arrays_of(message.content.array_records["arrays"])) == {WK, BN}
        config = message.content.config_records["config"]
        assert config["reference-upload"] == upload
        assert config["server-round"] == 1
    assert server.num_clients == 3


def test_two_rounds_partial_participation_by_hand():
    """K = 3 connected nodes, 2 replies per round, eta = 0.1, E_k = 2 and 4."""
    server = fedspc(fraction_train=0.67)  # int(3 * 0.67) = 2 sampled of 3
    grid = FakeGrid([1, 2, 3])
    K, eta = 3, 0.1

    # ---------------------------------------------------------------- round 1
    # Prepare
    theta1 = np.array([1.0, -2.0])
    u_bar0 = np.zeros(2)
    final_a, steps_a = np.array([0.7, -1.5]), 2
    final_b, steps_b = np.array([1.4, -2.2]), 4
    messages = list(server.configure_train(
        1, record({WK: theta1.astype(np.float32), BN: np.array(10, dtype=np.int64)}),
        ConfigRecord(), grid))
    assert len(messages) == 2

    # Execute
    arrays1, metrics1 = server.aggregate_train(1, [
        spc_reply(final_a, 12, steps_a, node=1),
        spc_reply(final_b, 16, steps_b, node=2),
    ])

    # Assert: theta = plain mean of the final params; BN averaged, not corrected
    out1 = arrays_of(arrays1)
    np.testing.assert_allclose(out1[WK], (final_a + final_b) / 2, rtol=1e-6)
    np.testing.assert_allclose(out1[WK], [1.05, -1.85], rtol=1e-6)
    assert out1[WK].dtype == np.float32
    assert out1[BN] == 14 and out1[BN].dtype == np.int64
    assert out1[BN].shape == (), "a 0-d buffer must stay 0-d in the new arrays"
    # u_k^{t+1} - u_k^t = -u_bar^t - (final - theta) / (E eta)
    change_a = -u_bar0 - (final_a - theta1) / (steps_a * eta)  # [1.5, -2.5]
    change_b = -u_bar0 - (final_b - theta1) / (steps_b * eta)  # [-1.0, 0.5]
    u_bar1 = u_bar0 + (change_a + change_b) / K  # [1/6, -2/3]
    assert set(server.global_reference) == {WK}
    assert server.global_reference[WK].dtype == np.float32
    np.testing.assert_allclose(server.global_reference[WK], [1 / 6, -2 / 3], rtol=1e-5)
    assert metrics1["global-reference-norm"] == pytest.approx(np.linalg.norm(u_bar1),
                                                              rel=1e-5)
    assert metrics1["clients"] == 2

    # ---------------------------------------------------------------- round 2
    # Prepare: the new theta goes out with u_bar^1
    theta2 = out1[WK].astype(np.float64)
    messages = list(server.configure_train(2, arrays1, ConfigRecord(), grid))
    sent_reference = arrays_of(messages[0].content.array_records["global-reference"])
    np.testing.assert_allclose(sent_reference[WK], u_bar1, rtol=1e-5, atol=1e-6)
    final_c, steps_c = theta2 + np.array([0.1, -0.2]), 4
    final_a2, steps_a2 = theta2 + np.array([-0.3, 0.1]), 2

    # Execute
    arrays2, _ = server.aggregate_train(2, [
        spc_reply(final_c, 20, steps_c, node=3),
        spc_reply(final_a2, 18, steps_a2, node=1),
    ])

    # Assert
    out2 = arrays_of(arrays2)
    np.testing.assert_allclose(out2[WK], (final_c + final_a2) / 2, rtol=1e-6)
    assert out2[BN] == 19
    change_c = -u_bar1 - (final_c - theta2) / (steps_c * eta)  # -u_bar1 - [0.25, -0.5]
    change_a2 = -u_bar1 - (final_a2 - theta2) / (steps_a2 * eta)  # -u_bar1 - [-1.5, 0.5]
    u_bar2 = u_bar1 + (change_c + change_a2) / K
    # = u_bar1/3 + [1.25, 0]/3 = [1/18 + 5/12, -2/9]
    np.testing.assert_allclose(server.global_reference[WK], u_bar2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(server.global_reference[WK], [1 / 18 + 5 / 12, -2 / 9],
                               rtol=1e-5)


@pytest.mark.parametrize("corrected", [[WK], [WK, B]], ids=["fedspc", "scaffold"])
def test_weighted_u_bar_moves_by_the_count_times_the_weighted_mean_change_by_hand(
        corrected):
    """aggregation = "weighted": K = 2 clients of 10 and 30 images, eta = 0.1, E = 1.
    u_bar moves by (count / K) times the changes' mean weighted as theta_s is, so it
    stays the weighted mean of the u_k (SCAFFOLD: every shared parameter corrected)."""
    server = FedSPC(shared_keys=[WK, B], num_partitions=2, corrected_keys=corrected,
                    learning_rate=ETA, aggregation="weighted")
    assert server.reference == "increment"
    grid, theta = FakeGrid([1, 2]), {WK: f32(0.0), B: f32(0.0)}
    own = {0: 0.0, 1: 0.0}  # each client's u_k, by hand
    for server_round, (delta_a, delta_b, u_bar) in enumerate(
            [(-0.1, 0.1, -0.5), (0.2, -0.1, 0.25)], start=1):
        server.configure_train(server_round, record(theta), ConfigRecord(), grid)
        previous = float(server.global_reference[WK][0])
        replies = [reply({k: theta[k] + f32(delta) for k in theta}, node=node,
                         **{"num-examples": images, "shared-steps": 1})
                   for node, delta, images in ((1, delta_a, 10), (2, delta_b, 30))]
        arrays, _ = server.aggregate_train(server_round, replies)
        theta = arrays_of(arrays)
        # Round 1: changes -0 - (-0.1)/0.1 = 1 and -1; (2/2)(10 * 1 - 30 * 1)/40 = -0.5.
        # Round 2: changes 0.5 - 2 = -1.5 and 0.5 + 1 = 1.5; -0.5 + 30/40 = 0.25.
        for pid, delta in ((0, delta_a), (1, delta_b)):
            own[pid] += -previous - delta / ETA
        assert (10 * own[0] + 30 * own[1]) / 40 == pytest.approx(u_bar)
        for key in corrected:
            np.testing.assert_allclose(server.global_reference[key], [u_bar], rtol=1e-6)
    np.testing.assert_allclose(theta[WK], [(10 * -0.1 + 30 * 0.1 + 10 * 0.2 - 30 * 0.1) / 40],
                               atol=1e-7)  # theta_s: the weighted mean, as before


def test_k_counts_the_runs_clients_not_the_replies_nor_the_connected_nodes():
    # Prepare: K = 4 clients; the grid also lists a stale fifth node; only one reply
    server = fedspc(num_partitions=4)
    server.configure_train(1, record({WK: f32(0.0, 0.0), BN: np.array(0)}),
                           ConfigRecord(), FakeGrid([1, 2, 3, 4, 5]))

    # Execute: Delta = [0.2, -0.4], E = 1 -> change = [-2, 4]; u_bar = change / 4
    server.aggregate_train(1, [spc_reply([0.2, -0.4], 0, 1, node=1)])

    # Assert
    np.testing.assert_allclose(server.global_reference[WK], [-0.5, 1.0], rtol=1e-5)


K_NODES = (1, 2, 3)
START = [0.3, -0.7]
# Per round: (final w, final buffer, shared steps E_k, node) of each reply.
PLANS = [
    [([0.1, -0.4], 7, 3, 1), ([0.9, -1.1], 9, 5, 2), ([0.35, -0.65], 6, 1, 3)],
    [([0.2, 0.3], 11, 2, 2), ([0.6, -0.9], 13, 7, 3)],
]


def _algorithm_1(received: np.ndarray, u_bar: np.ndarray, final, steps: int) -> np.ndarray:
    """Client k's reference change, step 3 of Algorithm 1, in float64:
    Delta u_k = -u_bar - Delta theta_k / (E eta) with Delta theta_k = final - received."""
    delta = np.asarray(final, dtype=np.float64) - received
    return -u_bar - delta / (steps * ETA)


def _expected_two_rounds() -> list[dict]:
    """Algorithm 1 on the plans in plain numpy (float64), round by round.

    Client k: u_k <- u_k + Delta u_k. Server (step 4): theta <- mean of the finals
    (unweighted), u_bar <- u_bar + (1/K) sum_{k in S_t} Delta u_k, K = 3 connected.
    Round 1 by hand: Delta theta = [-0.2, 0.3], [0.6, -0.4], [0.05, 0.05] with E = 3,
    5, 1 -> Delta u = [2/3, -1], [-1.2, 0.8], [-0.5, -0.5]; u_bar^1 = [-31/90, -7/30].
    """
    theta = np.array(START, dtype=np.float64)
    u_bar = np.zeros(2)
    u = {node: np.zeros(2) for node in K_NODES}
    rounds = []
    for plan in PLANS:
        changes = {node: _algorithm_1(theta, u_bar, final, steps)
                   for final, _, steps, node in plan}
        for node, change in changes.items():
            u[node] = u[node] + change
        u_bar = u_bar + sum(changes.values()) / len(K_NODES)
        theta = np.mean([np.asarray(final, dtype=np.float64) for final, *_ in plan], axis=0)
        rounds.append({"changes": changes, "u_bar": u_bar, "theta": theta,
                       "u": {node: value.copy() for node, value in u.items()}})
    return rounds


def _play_two_rounds(upload: str, changes: list[dict] | None = None) -> list[dict]:
    """Run the plans through FedSPC; explicit replies carry ``changes[round][node]``.

    Returns, per round, the broadcast the clients received, the u_bar they received,
    the aggregated arrays and the server's u_bar afterwards.
    """
    server = fedspc(upload)
    grid = FakeGrid(K_NODES)
    # (a 1-element buffer, so this test is only about the reference change)
    arrays = record({WK: f32(*START), BN: np.array([5], dtype=np.int64)})
    history = []
    for server_round, plan in enumerate(PLANS, start=1):
        messages = list(server.configure_train(server_round, arrays, ConfigRecord(), grid))
        received = arrays_of(messages[0].content.array_records["arrays"])
        sent_u_bar = arrays_of(messages[0].content.array_records["global-reference"])
        replies = []
        for final, bn, steps, node in plan:
            change = None
            if changes is not None:  # what the client computed and uploads
                change = {WK: changes[server_round - 1][node].astype(np.float32)}
            replies.append(spc_reply(final, [bn], steps, node, change=change))
        arrays, _ = server.aggregate_train(server_round, replies)
        history.append({"received": received[WK], "sent-u-bar": sent_u_bar[WK],
                        "arrays": arrays_of(arrays),
                        "u-bar": server.global_reference[WK].copy()})
    return history


def test_explicit_and_derived_uploads_follow_algorithm_1():
    expected = _expected_two_rounds()
    derived = _play_two_rounds("derived")
    explicit = _play_two_rounds("explicit", [r["changes"] for r in expected])
    for r, (want, d, e) in enumerate(zip(expected, derived, explicit)):
        # Both modes give the same parameters: the plain mean of the finals.
        assert d["arrays"].keys() == e["arrays"].keys() == {WK, BN}
        for key in (WK, BN):
            assert d["arrays"][key].dtype == e["arrays"][key].dtype
            np.testing.assert_array_equal(d["arrays"][key], e["arrays"][key])
        np.testing.assert_allclose(d["arrays"][WK], want["theta"], rtol=1e-6)
        # ... and the same u_bar, the one Algorithm 1 gives: u_bar = mean of u_k over
        # all K clients (sampled or not), since every u_k and u_bar start at 0.
        for got in (d["u-bar"], e["u-bar"]):
            assert got.dtype == np.float32
            np.testing.assert_allclose(got, want["u_bar"], rtol=1e-5, atol=1e-6,
                                       err_msg=f"round {r + 1}")
            np.testing.assert_allclose(got, np.mean(list(want["u"].values()), axis=0),
                                       rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(d["u-bar"], e["u-bar"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(derived[0]["u-bar"], [-31 / 90, -7 / 30], rtol=1e-5)
    # Round 2 went out with round 1's theta and u_bar.
    for played in (derived, explicit):
        np.testing.assert_array_equal(played[0]["sent-u-bar"], [0.0, 0.0])
        np.testing.assert_allclose(played[1]["received"], expected[0]["theta"], rtol=1e-6)
        np.testing.assert_allclose(played[1]["sent-u-bar"], expected[0]["u_bar"], rtol=1e-5)
    # The second round moved u_bar again.
    assert np.max(np.abs(derived[1]["u-bar"] - derived[0]["u-bar"])) > 0.1


def test_an_uploaded_change_its_update_does_not_imply_is_dropped():
    """In explicit mode the uploaded change must be the one the reply's own shared
    update implies (the client's arithmetic is the server's): one that is not, here
    Algorithm 1's plus [1, -2], would move the client's u_k apart from what it sent
    for theta_s, and the reply is dropped with the reason."""
    server, _ = _explicit_round(spc_reply([1.2, 0.6], 2, 1, node=2,
                                          change={WK: f32(-2.0 + 1.0, 4.0 - 2.0)}))
    assert any("is not the one its shared update and 'shared-steps' imply" in reason
               for reason in server.report.reasons)
    # The same reply with the change its update implies is aggregated.
    _, arrays = _explicit_round_pair()
    assert arrays[WK] == pytest.approx([1.2, 0.6])


def _explicit_round_pair() -> tuple[FedSPC, dict]:
    server = fedspc("explicit", num_partitions=2)
    server.configure_train(1, record({WK: f32(1.0, 1.0), BN: np.array(0)}),
                           ConfigRecord(), FakeGrid([1, 2]))
    change = {WK: f32(-2.0, 4.0)}
    arrays, metrics = server.aggregate_train(
        1, [spc_reply([1.2, 0.6], 2, 1, node=n, change=change) for n in (1, 2)])
    assert metrics["clients"] == 2
    return server, arrays_of(arrays)


def _explicit_round(bad: Message) -> tuple[FedSPC, dict]:
    """One explicit round with a good reply from node 1 and ``bad``."""
    server = fedspc("explicit", num_partitions=2)
    server.configure_train(1, record({WK: f32(1.0, 1.0), BN: np.array(0)}),
                           ConfigRecord(), FakeGrid([1, 2]))
    good_change = {WK: f32(-2.0, 4.0)}
    arrays, metrics = server.aggregate_train(
        1, [spc_reply([1.2, 0.6], 2, 1, node=1, change=good_change), bad])
    assert metrics["clients"] == 1
    return server, arrays_of(arrays)


@pytest.mark.parametrize(
    "change",
    [None, {"body.other": f32(1.0, 1.0)}, {WK: f32(1.0, 1.0), BN: np.array(1.0)},
     {WK: f32(1.0)}, {WK: f32(np.nan, 1.0)}],
    ids=["missing", "wrong-key", "extra-key", "wrong-shape", "nan"],
)
def test_explicit_reply_with_a_bad_reference_change_is_dropped(change):
    # Execute
    server, out = _explicit_round(spc_reply([5.0, 5.0], 8, 1, node=2, change=change))

    # Assert: only the good reply counted, for theta and for u_bar (K = 2)
    np.testing.assert_allclose(out[WK], [1.2, 0.6], rtol=1e-6)
    assert out[BN] == 2
    np.testing.assert_allclose(server.global_reference[WK], [-1.0, 2.0], rtol=1e-6)


def test_explicit_reply_without_reference_change_alone_fails_the_round():
    server = fedspc("explicit", num_partitions=2)
    server.configure_train(1, record({WK: f32(1.0, 1.0), BN: np.array(0)}),
                           ConfigRecord(), FakeGrid([1, 2]))
    assert server.aggregate_train(1, [spc_reply([1.2, 0.6], 2, 1, node=1)]) == (None, None)
    assert server.report.failed and "reference-change" in server.report.reasons[0]
    np.testing.assert_array_equal(server.global_reference[WK], [0.0, 0.0])  # unchanged


@pytest.mark.parametrize("upload", ["derived", "explicit"])
@pytest.mark.parametrize("steps", [None, 0, -1], ids=["missing", "zero", "negative"])
def test_reply_without_positive_shared_steps_is_dropped(upload, steps):
    # Prepare
    server = fedspc(upload, num_partitions=2)
    theta = {WK: f32(1.0, 1.0), BN: np.array(0, dtype=np.int64)}
    server.configure_train(1, record(theta), ConfigRecord(), FakeGrid([1, 2]))
    good_change = {WK: f32(-2.0, 4.0)}  # = -0 - [0.2, -0.4] / (1 * 0.1)
    explicit = upload == "explicit"  # a reference change goes only where asked for
    good = spc_reply([1.2, 0.6], 2, 1, node=1, change=good_change if explicit else None)
    bad = spc_reply([5.0, 5.0], 8, steps, node=2,
                    change={WK: f32(3.0, 3.0)} if explicit else None)

    # Execute
    arrays, metrics = server.aggregate_train(1, [bad, good])

    # Assert
    assert metrics["clients"] == 1
    np.testing.assert_allclose(arrays_of(arrays)[WK], [1.2, 0.6], rtol=1e-6)
    np.testing.assert_allclose(server.global_reference[WK], [-1.0, 2.0], rtol=1e-5)


def test_all_replies_without_shared_steps_fail_the_round():
    server = fedspc(num_partitions=2)
    server.configure_train(1, record({WK: f32(1.0, 1.0), BN: np.array(0)}),
                           ConfigRecord(), FakeGrid([1, 2]))
    assert server.aggregate_train(1, [spc_reply([1.2, 0.6], 2, 0, node=1),
                                      spc_reply([1.2, 0.6], 2, None, node=2)]) == (None, None)
    assert all("shared-steps" in reason for reason in server.report.reasons)


def test_fedspc_error_reply_is_dropped():
    server = fedspc(num_partitions=2)
    server.configure_train(1, record({WK: f32(1.0, 1.0), BN: np.array(0)}),
                           ConfigRecord(), FakeGrid([1, 2]))
    arrays, metrics = server.aggregate_train(
        1, [error_reply(node=2), spc_reply([1.2, 0.6], 2, 1, node=1)])
    assert metrics["clients"] == 1
    np.testing.assert_allclose(arrays_of(arrays)[WK], [1.2, 0.6], rtol=1e-6)
    np.testing.assert_allclose(server.global_reference[WK], [-1.0, 2.0], rtol=1e-5)


def test_fedspc_evaluation_is_delegated():
    server = bound(FedSPC(shared_keys=[WK, BN], corrected_keys=[WK], learning_rate=ETA),
                   [1, 2])
    result = server.aggregate_evaluate(2, [eval_reply(0, 3, 4, 1.0, node=1),
                                           eval_reply(1, 1, 4, 3.0, node=2)])
    assert result["accuracy"] == pytest.approx(0.5)
    assert result["loss"] == pytest.approx(0.5)


def test_fedspc_state_round_trips_through_a_checkpoint():
    server = fedspc(num_partitions=4)
    server.configure_train(1, record({WK: f32(0.0, 0.0), BN: np.array(0)}),
                           ConfigRecord(), FakeGrid([1, 2, 3, 4]))
    server.aggregate_train(1, [spc_reply([0.2, -0.4], 0, 1, node=1)])
    restored = fedspc(num_partitions=4)
    restored.load_state_dict(server.state_dict(), 1, global_reference=server.state_arrays())
    assert restored.num_clients == 4
    np.testing.assert_array_equal(restored.global_reference[WK], server.global_reference[WK])
    assert restored.accepted_rounds == server.accepted_rounds
    assert restored.durable_through == 1
