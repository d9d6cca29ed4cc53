"""What a client sends cannot crash the server or leak into an aggregate
(fedspc_app.core.replies, the strategies' reply checks, the node binding).

Explicit regressions first (each attack that was tried, dropped with its reason while
the round completes), then property-based fuzzing with Hypothesis: arbitrary records,
arrays and metrics mixed with honest replies, through the whole reply handling and
aggregation of PersonalizedFedAvg and FedSPC under every aggregation rule. The
default run tries a few hundred cases; ``pytest -m slow tests/test_replies.py`` tries
ten thousand and more.
"""

from __future__ import annotations

import functools
import math
import time
from io import BytesIO
from pathlib import Path

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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_strategies import FakeGrid, arrays_of, f32, from_node, instruction, record

from fedspc_app.core import replies
from fedspc_app.core.correction import reference_change, shared_update
from fedspc_app.core.dp_mechanism import clip_update
from fedspc_app.core.replies import (
    MAX_ARRAY_VALUE,
    evaluate_schema,
    node_answer_schema,
    partition_report_schema,
    train_schema,
)
from fedspc_app.core.startup import worker_startup
from strategies import AggregationRule, FedSPC, PersonalizedFedAvg, Privacy, ServerOptimizer
from strategies.aggregation import AGGREGATIONS, mean_arrays
from strategies.rounds import dispatch_waves, expected_seconds, record_durations
from strategies.sampling import PartitionSampler

pytestmark = pytest.mark.usefixtures("task_identity")

W, B, NBT = "body.weight", "body.bias", "bn.num_batches_tracked"
SHARED = {W: f32(1.0, -2.0, 3.0), B: f32(0.5), NBT: np.array(4, dtype=np.int64)}
CORRECTED = (W, B)
K = 6  # clients; node n holds partition n - 1
ROBUSTNESS = Path(__file__).resolve().parent.parent / "docs" / "robustness.md"


def metrics_of(values: dict) -> MetricRecord:
    """A MetricRecord holding ``values`` as given: past MetricRecord's own type check,
    as a deserializer that does not check (or a modified client library) could hand
    them to the server."""
    metrics = MetricRecord()
    metrics.__dict__["_data"].update(values)
    return metrics


def honest_metrics(node: int, **extra) -> dict:
    return {"partition-id": node - 1, "num-examples": 10 * node, "train-loss": 1.5,
            "shared-steps": 2, "examples-seen": 20 * node, "rounds-trained": 1,
            "setup-seconds": 0.1, "work-seconds": 0.5, "within-clipping-norm": node % 2,
            **extra}


def train_reply(node: int, arrays: dict | None = None, metrics: dict | None = None,
                change: dict | None = None) -> Message:
    content = RecordDict({
        "arrays": record(SHARED if arrays is None else arrays),
        "metrics": metrics_of(honest_metrics(node) if metrics is None else metrics)})
    if change is not None:
        content["reference-change"] = record(change)
    return from_node(Message(content=content, dst_node_id=0,
                             message_type=MessageType.TRAIN), node)


def eval_reply(node: int, **metrics) -> Message:
    values = {"partition-id": node - 1, "num-examples": 10, "correct": 7, "loss-sum": 4.0,
              **metrics}
    return from_node(Message(content=RecordDict({"metrics": metrics_of(values)}),
                             dst_node_id=0, message_type=MessageType.EVALUATE), node)


def server(kind: str = "plain", rule: str = "mean", **kwargs):
    """A strategy of ``kind`` whose round 1 broadcast SHARED to nodes 1..K."""
    common = dict(shared_keys=list(SHARED), num_partitions=K,
                  aggregation=AggregationRule(rule, trim_fraction=0.2, byzantine=1),
                  **kwargs)
    if kind == "plain":
        strategy = PersonalizedFedAvg(**common)
    else:
        strategy = FedSPC(corrected_keys=CORRECTED, learning_rate=0.1,
                          upload="explicit" if kind == "explicit" else "derived", **common)
    strategy.configure_train(1, record(SHARED), ConfigRecord(), FakeGrid(range(1, K + 1)))
    return strategy


def good_pair() -> list[Message]:
    return [train_reply(1, {W: f32(2.0, 0.0, 1.0), B: f32(1.0), NBT: np.array(6)}),
            train_reply(2, {W: f32(0.0, 2.0, 3.0), B: f32(0.0), NBT: np.array(8)})]


def assert_round_of_the_good_pair(strategy, bad: Message, needle: str) -> None:
    """``bad`` beside two good replies: dropped with a reason naming ``needle``, and
    the round is the good pair's mean."""
    reason = strategy.check_reply(bad)
    assert reason is not None and needle in reason, reason
    arrays, metrics = strategy.aggregate_train(1, [good_pair()[0], bad, good_pair()[1]])
    out = arrays_of(arrays)
    np.testing.assert_array_equal(out[W], f32(1.0, 1.0, 2.0))
    assert out[W].dtype == np.float32 and out[NBT].dtype == np.int64 and out[NBT] == 7
    assert metrics["clients"] == 2 and not strategy.report.failed
    first = strategy.report.reasons[0]
    assert first.startswith(f"node {bad.metadata.src_node_id}: ") and "\n" not in first


# ----------------------------------------------------------- explicit regressions
def npy(descr: str, shape: tuple, data: bytes = b"", fortran: bool = False) -> Array:
    """An Array whose .npy header says ``descr`` and ``shape`` over ``data``."""
    buffer = BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": descr, "fortran_order": fortran, "shape": shape})
    return Array(dtype="float32", shape=(3,), stype="numpy.ndarray",
                 data=buffer.getvalue() + data)


def with_array(key: str, array) -> Message:
    message = train_reply(3)
    target = message.content.array_records["arrays"]
    target.__dict__["_data"][key] = array if not isinstance(array, np.ndarray) \
        else Array(array)
    return message


BAD_TRAIN = {
    "list-train-loss": (lambda: train_reply(3, metrics=honest_metrics(3, **{"train-loss": [1.0]})),
                        "'train-loss'"),
    "nan-train-loss": (lambda: train_reply(3, metrics=honest_metrics(3, **{"train-loss": np.nan})),
                       "'train-loss'"),
    "complex-array": (lambda: with_array(W, np.array([1, 2, 3], dtype=np.complex64)),
                      "dtype complex64"),
    "int64-array": (lambda: with_array(W, np.array([1, 2, 3], dtype=np.int64)), "dtype int64"),
    "float16-array": (lambda: with_array(W, np.array([1, 2, 3], dtype=np.float16)), "dtype float16"),
    "float64-array": (lambda: with_array(W, np.array([1, 2, 3], dtype=np.float64)), "dtype float64"),
    "big-endian": (lambda: with_array(W, np.array([1, 2, 3], dtype=">f4")), "dtype >f4"),
    "float-counter": (lambda: with_array(NBT, np.array(4.0)), "dtype float64"),
    "huge-float32": (lambda: with_array(W, f32(1e38, 1e38, 1e38)), "beyond"),
    "huge-counter": (lambda: with_array(NBT, np.array(2**62)), "beyond"),
    "inf": (lambda: with_array(B, f32(np.inf)), "non-finite"),
    "empty-array": (lambda: with_array(W, np.zeros(0, np.float32)), "shape (0,)"),
    "2d-array": (lambda: with_array(W, np.zeros((1, 3), np.float32)), "shape (1, 3)"),
    "object-header": (lambda: with_array(W, npy("|O", (3,), b"\x80\x04N.")), "dtype object"),
    "huge-declared-shape": (lambda: with_array(W, npy("<f4", (10**12,))), "shape (1000000000000,)"),
    "short-data": (lambda: with_array(W, npy("<f4", (3,), b"\x00" * 8)), "8 bytes"),
    # numpy's header parser takes a bool for a size, and (True,) == (1,): the view's
    # reshape then raised outside every check (one reply crashed the round).
    "bool-size": (lambda: with_array(B, npy("<f4", (True,), b"\x00" * 4)),
                  "non-integer sizes"),
    "garbage-bytes": (lambda: with_array(W, Array(dtype="float32", shape=(3,), stype="numpy.ndarray",
                                          data=b"PK\x03\x04 not a zip")), "readable"),
    "torch-stype": (lambda: with_array(W, Array(dtype="float32", shape=(3,), stype="torch.Tensor",
                                        data=b"")), "stype"),
    "not-an-array": (lambda: with_array(W, [1.0, 2.0, 3.0]), "not an Array"),
    "bool-partition-id": (lambda: train_reply(3, metrics=honest_metrics(3, **{"partition-id": True})),
                          "'partition-id' must be an integer (not a bool)"),
    "float-partition-id": (lambda: train_reply(3, metrics=honest_metrics(3, **{"partition-id": 2.0})),
                           "'partition-id'"),
    "bool-num-examples": (lambda: train_reply(3, metrics=honest_metrics(3, **{"num-examples": True})),
                          "'num-examples'"),
    "huge-num-examples": (lambda: train_reply(3, metrics=honest_metrics(3, **{"num-examples": 2**70})),
                          "'num-examples'"),
    "list-examples-seen": (lambda: train_reply(3, metrics=honest_metrics(3, **{"examples-seen": [1]})),
                           "'examples-seen'"),
    "negative-rounds-trained": (lambda: 
        train_reply(3, metrics=honest_metrics(3, **{"rounds-trained": -1})), "'rounds-trained'"),
    "inf-work-seconds": (lambda: train_reply(3, metrics=honest_metrics(3, **{"work-seconds": np.inf})),
                         "'work-seconds'"),
    "huge-setup-seconds": (lambda: 
        train_reply(3, metrics=honest_metrics(3, **{"setup-seconds": 1e308})), "'setup-seconds'"),
    "string-handler-time": (lambda: 
        train_reply(3, metrics=honest_metrics(3, **{"handler-started-at": "now"})),
        "'handler-started-at'"),
    "local-correct-alone": (lambda: 
        train_reply(3, metrics=honest_metrics(3, **{"local-correct": 3})), "'local-correct'"),
    "local-correct-too-many": (lambda: 
        train_reply(3, metrics=honest_metrics(3, **{"local-correct": 11, "local-examples": 10})),
        "'local-correct' is 11"),
    "metrics-as-config": (lambda: from_node(Message(RecordDict({
        "arrays": record(SHARED), "metrics": ConfigRecord({"partition-id": 2})}),
        dst_node_id=0, message_type=MessageType.TRAIN), 3), "no MetricRecord 'metrics'"),
    "arrays-as-metrics": (lambda: from_node(Message(RecordDict({
        "arrays": MetricRecord({"w": 1.0}), "metrics": metrics_of(honest_metrics(3))}),
        dst_node_id=0, message_type=MessageType.TRAIN), 3), "no ArrayRecord 'arrays'"),
    "second-array-record": (lambda: from_node(Message(RecordDict({
        "arrays": record(SHARED), "more": record(SHARED),
        "metrics": metrics_of(honest_metrics(3))}), dst_node_id=0,
        message_type=MessageType.TRAIN), 3), "unexpected records in the reply: [\"'more'\"]"),
    "config-record": (lambda: from_node(Message(RecordDict({
        "arrays": record(SHARED), "metrics": metrics_of(honest_metrics(3)),
        "config": ConfigRecord({"x": 1})}), dst_node_id=0,
        message_type=MessageType.TRAIN), 3), "unexpected records"),
    "unrequested-reference-change": (lambda: train_reply(3, change={W: f32(0, 0, 0), B: f32(0)}),
                                     "'reference-change'"),
    "wrong-partition": (lambda: train_reply(3, metrics=honest_metrics(3, **{"partition-id": 0})),
                        "node 3 is bound to partition 2, its reply claims 0"),
    "unbound-node": (lambda: from_node(train_reply(3), 99), "node 99 is bound to no partition"),
    "multi-line-error": (lambda: Message(Error(code=0, reason="Traceback:\n  boom\n" + "x" * 999),
                                 reply_to=instruction(3)), "client error: Traceback: boom"),
}


@pytest.mark.parametrize("kind", BAD_TRAIN)
def test_a_malformed_train_reply_is_dropped_and_the_round_completes(kind):
    bad, needle = BAD_TRAIN[kind]
    assert_round_of_the_good_pair(server(), bad(), needle)


@pytest.mark.parametrize("kind", ["plain", "derived", "explicit"])
def test_the_reply_checks_are_the_same_for_fedspc(kind):
    strategy = server(kind)
    # The reply sends the broadcast back (Delta = 0) and u_bar^1 = 0: the change its
    # update implies is 0.
    change = {W: f32(0.0, 0.0, 0.0), B: f32(0.0)} if kind == "explicit" else None
    metrics = honest_metrics(3, **{"partition-id": True})
    reason = strategy.check_reply(train_reply(3, metrics=metrics, change=change))
    assert "'partition-id' must be an integer (not a bool)" in reason
    assert strategy.check_reply(train_reply(3, change=change)) is None
    if kind == "explicit":  # any other change is not the one the update implies
        reason = strategy.check_reply(train_reply(3, change={W: f32(0.1, 0.2, 0.3),
                                                             B: f32(0.0)}))
        assert "is not the one its shared update and 'shared-steps' imply" in reason


@pytest.mark.parametrize("change,needle", [
    ({W: np.array([1, 2, 3], dtype=np.float64), B: f32(0.0)}, "dtype float64"),
    ({W: np.array([1, 2, 3], dtype=np.complex64), B: f32(0.0)}, "dtype complex64"),
    ({W: f32(1e30, 0, 0), B: f32(0.0)}, "beyond"),
    ({W: f32(0, 0, 0)}, "missing"),
])
def test_an_explicit_reference_change_has_u_bars_dtype_shapes_and_bounds(change, needle):
    strategy = server("explicit")
    reason = strategy.check_reply(train_reply(3, change=change))
    assert reason.startswith(("the 'reference-change' arrays", "reference-change")), reason
    assert needle in reason


def test_the_aggregation_reads_the_arrays_the_check_decoded():
    """A reply's arrays are decoded once: the check keeps read-only views of the
    reply's bytes, which the strategy reads (no second decode, no copy); an array no
    check decoded is decoded when read, and a reply that is gone leaves nothing kept."""
    import gc

    message = train_reply(3, arrays={W: f32(1.0, 2.0, 3.0), B: f32(0.25),
                                     NBT: np.array(5, dtype=np.int64)})
    unchecked = replies.reply_arrays(message, "arrays")
    assert all(v.flags.writeable for v in unchecked.values())  # decoded now, a copy
    assert train_schema(SHARED, K).check(message) is None
    kept = replies.reply_arrays(message, "arrays")
    assert kept.keys() == unchecked.keys()
    for key, value in kept.items():
        np.testing.assert_array_equal(value, unchecked[key])
        assert value.dtype == SHARED[key].dtype and value.shape == SHARED[key].shape
        assert not value.flags.writeable  # a view of the message's bytes
        assert np.shares_memory(value, np.frombuffer(
            message.content.array_records["arrays"][key].data, dtype=np.uint8))
    assert replies.reply_arrays(message, "arrays")[W] is kept[W]
    ids = [id(a) for a in message.content.array_records["arrays"].values()]
    assert all(i in replies._DECODED for i in ids)
    del message, kept, unchecked, value
    gc.collect()
    assert not any(i in replies._DECODED for i in ids)


def test_a_fortran_ordered_upload_decodes_to_its_values():
    """A .npy header may say Fortran order (a client's np.save of a transposed array):
    the view is laid out as the header says, the values are those numpy reads."""
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    array = Array(np.asfortranarray(values))
    decoded, problem = replies.decode_array(array, np.zeros((2, 3), np.float32))
    assert problem == ""
    np.testing.assert_array_equal(decoded, values)
    np.testing.assert_array_equal(decoded, array.numpy())


def test_fedspc_needs_a_positive_integer_step_count():
    strategy = server("derived")
    for steps in (0, True, 2.0, [2], None):
        metrics = honest_metrics(3, **{"shared-steps": steps})
        if steps is None:
            del metrics["shared-steps"]
        assert "shared-steps" in strategy.check_reply(train_reply(3, metrics=metrics))


BAD_EVALUATION = {
    "bool-correct": ({"correct": True}, "'correct'"),
    "list-loss-sum": ({"loss-sum": [1.0]}, "'loss-sum'"),
    "nan-loss-sum": ({"loss-sum": float("nan")}, "'loss-sum'"),
    "huge-loss-sum": ({"loss-sum": 1e308}, "'loss-sum'"),
    "bool-partition-id": ({"partition-id": False}, "'partition-id'"),
    "global-correct-float": ({"global-correct": 1.5, "global-examples": 10},
                             "'global-correct'"),
    "global-examples-zero": ({"global-correct": 0, "global-examples": 0},
                             "'global-examples'"),
    "wrong-partition": ({"partition-id": 0}, "bound to partition 2"),
}


@pytest.mark.parametrize("kind", BAD_EVALUATION)
def test_a_malformed_evaluation_reply_is_dropped_and_counted(kind):
    extra, needle = BAD_EVALUATION[kind]
    strategy = server()
    strategy.aggregate_train(1, good_pair())
    bad = eval_reply(3, **extra)
    assert needle in strategy.check_evaluation(bad)
    result = strategy.aggregate_evaluate(1, [eval_reply(1), bad, eval_reply(2, correct=9)])
    assert result["clients"] == 2 and result["accuracy"] == pytest.approx(0.8)
    assert strategy.report.evaluate_dropped == 1


def test_timings_and_start_times_a_client_sends_cannot_break_the_round_loop():
    # Two timings of 1e308 summed to inf, and int(inf) stopped the wave dispatch.
    replies = [train_reply(1, metrics=honest_metrics(1, **{"setup-seconds": 1e308,
                                                           "work-seconds": 1e308})),
               train_reply(2, metrics=honest_metrics(2, **{"handler-started-at": 1e308,
                                                           "app-import-started-at": -1e308,
                                                           "app-imported-at": 1e308})),
               train_reply(3, metrics=honest_metrics(3, **{"work-seconds": True})),
               train_reply(4)]
    assert [expected_seconds(r) for r in replies] == [None, pytest.approx(0.6), None,
                                                      pytest.approx(0.6)]
    durations: dict[int, float] = {}
    record_durations(durations, replies)
    messages = [instruction(node) for node in (1, 2, 3, 4)]
    assert sum(map(len, dispatch_waves(messages, durations, 10, 0.15))) == 4
    assert worker_startup(replies, time.time()) == {}


def test_a_partition_answer_with_a_bool_or_no_id_binds_nothing():
    sampler = PartitionSampler(3)
    answers = [from_node(Message(RecordDict({"metrics": metrics_of(values)}),
                                 dst_node_id=0, message_type=MessageType.QUERY), node)
               for node, values in ((1, {"partition-id": True}), (2, {}),
                                    (3, {"partition-id": 2}), (4, {"partition-id": 2}))]
    answers.append(Message(Error(code=0, reason="no"), reply_to=instruction(5)))
    sampler.bind_answers(answers)
    assert sampler.partition_of == {3: 2}  # node 4's claim of a held partition refused


def test_a_malformed_preflight_report_stops_the_run_with_its_reason():
    from fedspc_app.core.config import parse_run_config
    from fedspc_app.core.errors import FedSPCError
    from fedspc_app.data.run_data import KNOWN_SHAPES
    from fedspc_app.server.deployment import preflight

    shape = KNOWN_SHAPES["cifar10"]
    good = {"partition-id": 0, "train-counts": [1] * 10, "test-counts": [1] * 10,
            "tries": 1, "durable-state": 0}

    class Nodes:
        def get_node_ids(self):
            return [1, 2]

        def send_and_receive(self, messages, *, timeout=None):
            reports = {1: good, 2: {**good, "partition-id": True}}
            out = []
            for message in messages:
                message.metadata.__dict__["_message_id"] = f"q{message.metadata.dst_node_id}"
                out.append(Message(RecordDict({"metrics": metrics_of(
                    reports[message.metadata.dst_node_id])}), reply_to=message))
            return out

    with pytest.raises(FedSPCError, match=r"node 2: 'partition-id' must be an integer"):
        preflight(Nodes(), parse_run_config({"dataset": "cifar10"}), 2, shape)


# ---------------------------------------------------------------- the docs' list
def test_the_docs_name_every_field_the_server_reads():
    text = ROBUSTNESS.read_text()
    section = text.split("## Reply checks", 1)[1].split("\n## ", 1)[0]
    schemas = {
        "train": train_schema(SHARED, K, steps_required=True, reference_change=SHARED,
                              clipping_bit=True),
        "evaluate": evaluate_schema(K),
        "query": node_answer_schema(K),
        "preflight": partition_report_schema(K, 10),
    }
    for name, schema in schemas.items():
        for metric in schema.metrics:
            assert f"`{metric.key}`" in section, (name, metric.key)
        for rule in schema.rules:
            assert f"`{rule.part}` ≤ `{rule.whole}`" in section, (name, rule)
        for record_name in schema.arrays:
            assert f"`{record_name}`" in section, (name, record_name)
    for limit in ("2^40", "1e30", "1e9", "1e11"):
        assert limit in section
    assert f"±{replies._bound(MAX_ARRAY_VALUE)}" in section


# ------------------------------------------------------------------ fuzzing
DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int32, np.int64, np.uint8,
          np.bool_, np.complex64, np.complex128, np.dtype(">f4")]
JUNK = st.one_of(
    st.booleans(), st.integers(-2**70, 2**70), st.floats(),
    st.sampled_from([1e30, 1e31, 1e308, -0.0, 5e-324, 2**40, 2**40 + 1, 0, 1, -1]),
    st.lists(st.integers(-3, 3), max_size=3), st.lists(st.floats(), max_size=2),
    st.lists(st.booleans(), max_size=2), st.lists(st.lists(st.integers(), max_size=2),
                                                  max_size=2),
    st.text(max_size=4), st.none(), st.complex_numbers(), st.binary(max_size=4),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.sampled_from([np.float32(1.0), np.int64(3), np.bool_(True), np.float64("nan")]),
)
METRIC_KEYS = ["partition-id", "num-examples", "train-loss", "shared-steps", "examples-seen",
               "rounds-trained", "local-correct", "local-examples", "setup-seconds",
               "work-seconds", "handler-started-at", "process-started-at",
               "app-import-started-at", "app-imported-at", "correct", "loss-sum",
               "global-correct", "global-examples", "held-out", "within-clipping-norm",
               "unknown-key"]
RECORD_NAMES = ["arrays", "metrics", "reference-change", "config", "global-reference", ""]


def _elements(dtype: np.dtype):
    if dtype.kind == "f":
        return st.one_of(st.floats(width=32), st.sampled_from(
            [1e38, -3.4e38, 1e9, 1.0000001e9, np.nan, np.inf]))
    return st.integers(-2**63, 2**63 - 1)


@functools.cache
def hostile_array(dtype: str, shape: tuple) -> st.SearchStrategy:
    """Something in an ArrayRecord where an array of ``dtype`` and ``shape`` belongs:
    other dtypes, values (NaN, ±inf, 1e38), shapes; a .npy header that lies (an object
    array, a 10^12-element shape); raw bytes; or no Array at all. Built once per
    reference (Hypothesis strategies are costly to build)."""
    reference = np.dtype(dtype)
    headers = st.builds(npy, st.sampled_from(["<f4", "|O", "<c8", ">f4", "<i8", "|b1", "V8"]),
                        st.sampled_from([shape, (10**12,), (2**62, 4), (0,), (3, 1)]),
                        st.binary(max_size=40), st.booleans())
    raw = st.builds(lambda dtype, stype, data: Array(dtype=dtype, shape=(3,), stype=stype,
                                                     data=data),
                    st.text(max_size=5), st.sampled_from(["numpy.ndarray", "torch", ""]),
                    st.binary(max_size=80))
    return st.one_of(
        st.one_of(*[hnp.arrays(d, shape) for d in DTYPES]).map(Array),
        hnp.arrays(reference, shape, elements=_elements(reference)).map(Array),
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3).map(
            lambda other: Array(np.zeros(other, dtype=reference))),
        headers, raw, JUNK)


EXTRA_KEYS = st.lists(st.sampled_from(["head.weight", "", "é", W + " "]), max_size=2)
CHOICES = st.sampled_from(["honest", "hostile", "missing"])


@st.composite
def hostile_arrays(draw, references: dict) -> ArrayRecord:
    out = ArrayRecord()
    for key, reference in references.items():
        choice = draw(CHOICES)
        if choice == "honest":
            out[key] = Array(np.array(reference))
        elif choice == "hostile":
            out.__dict__["_data"][key] = draw(hostile_array(reference.dtype.str,
                                                            reference.shape))
    for key in draw(EXTRA_KEYS):
        out[key] = Array(f32(1.0))
    return out


CHANGES = {k: np.asarray(SHARED[k], np.float32) for k in CORRECTED}
METRIC_EDITS = st.lists(st.tuples(st.sampled_from(METRIC_KEYS), st.one_of(st.none(), JUNK)),
                        max_size=4)
EXTRA_RECORDS = st.lists(st.tuples(st.sampled_from(RECORD_NAMES), st.sampled_from(
    ["array", "metric", "config", "empty-metric"])), max_size=2)
ERRORS = st.tuples(st.integers(-5, 5), st.text(max_size=40))


@st.composite
def hostile_reply(draw, node: int, phase: str) -> Message:
    if draw(st.integers(0, 9)) == 0:
        code, reason = draw(ERRORS)
        return Message(Error(code=code, reason=reason), reply_to=instruction(node))
    values = honest_metrics(node) if phase == "train" else {
        "partition-id": node - 1, "num-examples": 10, "correct": 3, "loss-sum": 2.0}
    for key, value in draw(METRIC_EDITS):  # None: the key is removed
        if value is None:
            values.pop(key, None)
        else:
            values[key] = value
    records = {}
    if phase == "train":
        records["arrays"] = draw(hostile_arrays(SHARED))
        if draw(st.booleans()):
            records["reference-change"] = draw(hostile_arrays(CHANGES))
    records["metrics"] = metrics_of(values)
    for name, kind in draw(EXTRA_RECORDS):
        records[name] = {"array": ArrayRecord(), "metric": MetricRecord({"a": 1}),
                         "config": ConfigRecord({"b": "c"}), "empty-metric": MetricRecord()}[kind]
    kind = MessageType.TRAIN if phase == "train" else MessageType.EVALUATE
    sender = draw(st.sampled_from([node, node % K + 1, 99]))  # itself, a neighbour's id, none
    return from_node(Message(RecordDict(records), dst_node_id=0, message_type=kind), sender)


FLOAT32 = st.floats(-50.0, 50.0, width=32)
VECTOR, SCALAR = (hnp.arrays(np.float32, (n,), elements=FLOAT32) for n in (3, 1))
COUNTS = st.tuples(st.integers(0, 10**6), st.integers(1, 10**5), st.integers(1, 40),
                   st.floats(0, 20))


@st.composite
def honest_train_reply(draw, node: int, explicit: bool, clip: float | None = None) -> Message:
    """An honest reply; with ``clip`` (client clipping under privacy) its update of
    the floating-point shared keys clipped to that norm, as an honest client does."""
    counter, images, steps, loss = draw(COUNTS)
    arrays = {W: draw(VECTOR), B: draw(SCALAR), NBT: np.array(counter, dtype=np.int64)}
    if clip is not None:
        arrays = clip_update(arrays, SHARED, CORRECTED, clip)
    metrics = honest_metrics(node, **{"num-examples": images, "shared-steps": steps,
                                      "train-loss": loss})
    change = None
    if explicit:  # the change its update implies (u_bar^1 = 0, eta 0.1), as a client sends
        change = reference_change(shared_update(arrays, SHARED, CORRECTED),
                                  {k: np.zeros_like(SHARED[k]) for k in CORRECTED},
                                  steps=steps, learning_rate=0.1)
    return train_reply(node, arrays, metrics, change)


CONFIGS = [(kind, rule, extra) for kind in ("plain", "derived", "explicit")
           for rule in AGGREGATIONS for extra in ("",)]
CONFIGS += [(kind, "mean", extra) for kind in ("plain", "derived", "explicit")
            for extra in ("fedadam", "dp")]
CONFIGS += [(kind, "mean", "dp-adaptive") for kind in ("plain", "derived")]
CONFIGS += [("derived", "median", "client-centre"), ("explicit", "krum", "client-centre")]


def build(kind: str, rule: str, extra: str):
    kwargs = {}
    if extra == "fedadam":
        kwargs["server_optimizer"] = ServerOptimizer("fedadam", CORRECTED, learning_rate=0.1)
    if extra == "dp":
        kwargs["privacy"] = Privacy(clipping_norm=1.0, noise_multiplier=0.5, steps=2)
    if extra == "dp-adaptive":  # the clients' bits move C_t; u_bar smoothed
        kwargs["privacy"] = Privacy(clipping_norm=1.0, noise_multiplier=0.5, steps=2,
                                    clipping_quantile=0.5, count_stddev=1.0,
                                    reference_smoothing=0.5 if kind != "plain" else 0.0)
    if extra == "client-centre":
        kwargs["reference"] = "client-centre"
    return server(kind, rule, **kwargs)


def assert_usable(strategy, arrays, metrics) -> None:
    """What the server broadcasts next is finite with the broadcast's keys, dtypes and
    shapes; so is u_bar; every reason is one line."""
    if arrays is not None:
        out = arrays_of(arrays)
        assert set(out) == set(SHARED)
        for key, value in out.items():
            assert value.dtype == SHARED[key].dtype and value.shape == SHARED[key].shape
            assert np.all(np.isfinite(value))
        # (Drift diagnostics may be NaN by design: 0/0 when no client moved.)
        assert np.isfinite(metrics.get("global-reference-norm", 0.0))
    reference = getattr(strategy, "global_reference", None)
    if reference is not None:
        for key in CORRECTED:
            assert reference[key].dtype == np.float32 and np.all(np.isfinite(reference[key]))
    if strategy.release is not None:
        assert 0 < strategy.release.clipping_norm < math.inf
    assert all("\n" not in r and len(r) < replies.REASON_LENGTH + 100
               for r in strategy.report.reasons)


def state_of(strategy, arrays):
    reference = getattr(strategy, "global_reference", None) or {}
    release = strategy.release  # under privacy: adaptive clipping's C_t too
    return ({k: v.tobytes() for k, v in arrays_of(arrays).items()} if arrays else None,
            {k: v.tobytes() for k, v in reference.items()}, list(strategy.accepted_rounds),
            release.clipping_norm if release is not None else None)


NODES = st.integers(1, K)
TRAIN_REPLIES = {explicit: st.lists(st.one_of(
    NODES.flatmap(lambda node, explicit=explicit: honest_train_reply(node, explicit)),
    NODES.flatmap(lambda node: hostile_reply(node, "train"))), min_size=1, max_size=7)
    for explicit in (False, True)}
EVALUATE_REPLIES = st.lists(st.one_of(NODES.map(eval_reply),
                                      NODES.flatmap(lambda node: hostile_reply(node, "evaluate"))),
                            max_size=5)
CASES = st.sampled_from(CONFIGS).flatmap(lambda config: st.tuples(
    st.just(config), TRAIN_REPLIES[config[0] == "explicit"], EVALUATE_REPLIES))


def play(case) -> None:
    """One fuzz case: the server handles the mixed replies without raising, and a
    dropped reply leaves no trace (the same round without it gives the same state)."""
    (kind, rule, extra), train, evaluation = case
    strategy = build(kind, rule, extra)
    arrays, metrics = strategy.aggregate_train(1, train)
    assert_usable(strategy, arrays, metrics)
    checker = build(kind, rule, extra)  # check_reply changes nothing: one for all
    kept = [m for m in train if checker.check_reply(m) is None]
    again = build(kind, rule, extra)
    if strategy.privacy is not None:  # the same noise: the secret is each run's own
        again.use_secret(strategy.secret)
    assert state_of(again, again.aggregate_train(1, kept)[0]) == state_of(strategy, arrays)
    result = strategy.aggregate_evaluate(1, evaluation)
    for key, value in (result or {}).items():
        assert not isinstance(value, float) or np.isfinite(value), key
    durations: dict[int, float] = {}
    record_durations(durations, [*train, *evaluation])
    dispatch_waves([instruction(n) for n in range(1, K + 1)], durations, 10, 0.15)
    worker_startup([*train, *evaluation], time.time())
    strategy.sampler.bind_answers(evaluation)


FUZZ = settings(max_examples=250, derandomize=True, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))


@FUZZ
@given(CASES)
def test_fuzzed_replies_never_break_the_server(case):
    play(case)


@pytest.mark.slow
@settings(FUZZ, max_examples=12_000)
@given(CASES)
def test_fuzzed_replies_never_break_the_server_many(case):
    play(case)


@settings(FUZZ, max_examples=150)
@given(st.sampled_from(CONFIGS).flatmap(lambda config: st.tuples(
    st.just(config), st.lists(st.integers(1, K), min_size=1, max_size=K, unique=True).flatmap(
        lambda nodes: st.tuples(*[honest_train_reply(
            n, config[0] == "explicit", 1.0 if config[2].startswith("dp") else None)
            for n in nodes])))))
def test_honest_replies_all_pass_and_aggregate_as_before(case):
    (kind, rule, extra), honest = case
    strategy = build(kind, rule, extra)
    arrays, metrics = strategy.aggregate_train(1, list(honest))
    if rule in ("trimmed-mean", "median") and len(honest) <= 2:  # n <= 2f with f = 1
        assert arrays is None and strategy.report.failed
        assert any("n ≤ 2f" in r for r in strategy.report.reasons)
        return
    if rule in ("krum", "multi-krum") and len(honest) <= 4:  # n <= 2f + 2 with f = 1
        assert arrays is None and strategy.report.failed
        assert any("n > 2f + 2" in r for r in strategy.report.reasons)
        return
    assert strategy.report.accepted == len(honest)
    assert metrics.get("clients", len(honest)) == len(honest)  # (withheld under DP)
    assert_usable(strategy, arrays, metrics)
    if rule in ("mean", "weighted") and not extra:  # the paper's rule, bit for bit
        ordered = sorted(honest, key=lambda m: m.content.metric_records["metrics"]
                         ["partition-id"])
        updates = [arrays_of(m.content.array_records["arrays"]) for m in ordered]
        weights = ([float(m.content.metric_records["metrics"]["num-examples"])
                    for m in ordered] if rule == "weighted" else [1.0] * len(ordered))
        expected = mean_arrays(updates, weights)
        assert {k: v.tobytes() for k, v in arrays_of(arrays).items()} == \
            {k: v.tobytes() for k, v in expected.items()}


def test_a_reason_is_one_short_line():
    assert replies.one_line("a\n b\t c") == "a b c"
    assert len(replies.one_line("x" * 2 * replies.REASON_LENGTH)) == replies.REASON_LENGTH


def test_a_huge_or_deep_value_is_described_without_being_printed():
    """A reason names a bad value by its kind and length: a 10-million-item list or
    error text once cost the server over 700 MB and seconds (its repr, then a split of
    the whole text), and a value nested 100,000 lists deep raised RecursionError."""
    nested: list = []
    for _ in range(100_000):
        nested = [nested]
    for value, expected in ((list(range(1_000_000)), "a list of 1000000 values"),
                            (nested, "a list of 1 values"),
                            ("x" * 10_000_000, "'" + "x" * 60 + "'…"),
                            (10**5000, "an integer beyond ±1e30")):
        server = PersonalizedFedAvg(shared_keys=list(SHARED), num_partitions=K)
        server.configure_train(1, record(SHARED), ConfigRecord(), FakeGrid(range(1, K + 1)))
        metrics = honest_metrics(1)
        metrics["train-loss"] = value
        server.aggregate_train(1, [train_reply(1, metrics=metrics)])
        reason = server.report.reasons[0]
        assert expected in reason and len(reason) <= replies.REASON_LENGTH + 20, reason[:200]
    text = " word" * 10_000_000
    assert replies.one_line(text, 200) == ("word " * 40)[:199] + "…"
    assert replies.one_line(text) == ("word " * (replies.REASON_LENGTH // 5 + 1))[
        :replies.REASON_LENGTH - 1] + "…"


def test_a_long_client_error_keeps_its_start_and_its_last_line():
    """A Ray worker's error is a traceback whose last line says what went wrong."""
    error = ("Traceback (most recent call last):\n" + "  File 'x.py', line 1\n" * 500
             + "DurableStateError: this node does not see the client-state folder")
    kept = replies.one_line(error, replies.ERROR_LENGTH, tail=True)
    assert len(kept) <= replies.ERROR_LENGTH and "\n" not in kept
    assert kept.startswith("Traceback (most recent call last):")
    assert kept.endswith("DurableStateError: this node does not see the client-state folder")
    assert replies.one_line("a  short\nerror", replies.ERROR_LENGTH, tail=True) == "a short error"
