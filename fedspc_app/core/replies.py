"""What the server reads from a client's reply, and the checks it passes first.

Every field the server reads from a reply is declared here, once: which records a
reply holds (by name and kind), which arrays each ArrayRecord holds (keys, dtypes and
shapes equal to what the server sent or keeps, values finite and within
±:data:`MAX_ARRAY_VALUE`), and the type and range of every metric
(:class:`Metric`: an integer that is not a bool, or a finite number, within bounds;
a list of integers of a given length). A reply is checked against its
:class:`ReplySchema` before anything in it is used, and a reply that fails is dropped
with one reason. Metrics the server does not read are not checked (nor used). The
check decodes each array once; :func:`reply_arrays` gives the strategies those
decoded arrays (read-only views of the reply's bytes) instead of decoding them again.

The bounds keep every sum the server forms finite and exact: counts are at most
2^40 (their sum over a million clients still fits in an int64), floating-point
metrics at most 1e30, array entries at most 1e9 in absolute value (squares, sums and
the reference change's division by E·η stay far inside float32's range). The
schemas of the replies the server reads are built by :func:`train_schema`,
:func:`evaluate_schema`, :func:`node_answer_schema` and
:func:`partition_report_schema`; docs/robustness.md lists them (a test checks that
it names every field).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from io import BytesIO

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord

from fedspc_app.core.protocol import (
    APP_IMPORT_STARTED_AT,
    APP_IMPORTED_AT,
    ARRAYS,
    CORRECT,
    EXAMPLES_SEEN,
    GLOBAL_CORRECT,
    GLOBAL_EXAMPLES,
    HANDLER_STARTED_AT,
    LOCAL_CORRECT,
    LOCAL_EXAMPLES,
    LOSS_SUM,
    METRICS,
    NUM_EXAMPLES,
    PARTITION_ID,
    PROCESS_STARTED_AT,
    REFERENCE_CHANGE,
    ROUNDS_TRAINED,
    SHARED_STEPS,
    TIMINGS,
    TRAIN_LOSS,
    WITHIN_CLIPPING_NORM,
)
from fedspc_app.core.records import ArrayDict

MAX_COUNT = 2**40  # images, steps, rounds
MAX_NUMBER = 1e30  # losses and other floating-point metrics
MAX_SECONDS = 1e9  # a client's timings
MAX_EPOCH = 1e11  # wall-clock epochs (the year 5138)
MAX_ARRAY_VALUE = 1e9  # |entry| of an uploaded array
REASON_LENGTH = 1200  # characters of a logged reason
ERROR_LENGTH = 1000  # characters of a client's error text within it (paths can be long)

INT, NUMBER, INT_LIST = "integer", "number", "integer list"
NPY_VERSIONS = ((1, 0), (2, 0))  # what np.save writes for a plain array


def one_line(text: object, limit: int = REASON_LENGTH, *, tail: bool = False) -> str:
    """``text`` on one line, at most ``limit`` characters (a client's error text may
    hold a traceback, and any length: it is cut before it is split, so a long one
    costs no more than a short one). With ``tail``, a long text keeps its start and
    its end (a traceback's last line says what went wrong)."""
    text = text if isinstance(text, str) else str(text)
    if not tail:
        line = " ".join(text[:4 * limit + 4].split())
        return line if len(line) <= limit else line[:limit - 1] + "…"
    line = " ".join(text.split()) if len(text) <= 4 * limit else ""
    if line and len(line) <= limit:
        return line
    head = one_line(text, limit // 3)
    end = " ".join(text[-4 * limit:].split())[-(limit - len(head) - 1):]
    return f"{head[:-1]}…{end}"


def shown(value: object, limit: int = 60) -> str:
    """A short description of a client's ``value`` that costs nothing to make: a list's
    length rather than its items, a string's first characters, a type's name."""
    if isinstance(value, (list, tuple, dict, set)):
        return f"a {type(value).__name__} of {len(value)} values"
    if isinstance(value, (str, bytes)):
        return repr(value[:limit]) + ("…" if len(value) > limit else "")
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return repr(value) if abs(value) < 10**30 else "an integer beyond ±1e30"
    if isinstance(value, float):
        return repr(value)
    return f"a {type(value).__name__}"


def _names(values: Iterable[object]) -> list[str]:
    """Up to three of ``values`` (sorted), each shown short."""
    return sorted(shown(v) for v in values)[:3]


def _bound(value: float) -> str:
    """A bound as the docs write it: 2^40, 1e30, 1e9, 0, 5."""
    if value == MAX_COUNT:
        return "2^40"
    if abs(value) < 1e6:
        return f"{value:g}"
    mantissa, exponent = f"{value:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def is_int(value: object) -> bool:
    """An integer that is not a bool (``True`` is an ``int`` in Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Metric:
    """One metric the server reads: its type, its bounds and whether it must be there.

    Parameters
    ----------
    key : str
        The metric's key in the reply's ``metrics`` record.
    kind : {"integer", "number", "integer list"}
        ``integer``: an int that is not a bool; ``number``: such an int or a finite
        float; ``integer list``: a list of ``length`` integers, each within the bounds.
    low, high : float
        The inclusive range of the value (of each element of a list).
    required : bool (default: False)
        A reply without it is dropped; an optional one is checked when present.
    length : int | None (default: None)
        The length of an ``integer list``.
    """

    key: str
    kind: str
    low: float
    high: float
    required: bool = False
    length: int | None = None

    def describe(self) -> str:
        """The check in words, as docs/robustness.md lists it."""
        bounds = f"in [{_bound(self.low)}, {_bound(self.high)}]"
        if self.kind == INT_LIST:
            return f"a list of {self.length} integers, each {bounds}"
        what = "an integer (not a bool)" if self.kind == INT else "a finite int or float"
        return f"{what} {bounds}"

    def problem(self, value: object) -> str | None:
        """Why ``value`` is not a valid value of this metric (``None``: it is)."""
        if self.kind == INT_LIST:
            valid = (isinstance(value, list) and len(value) == self.length
                     and all(is_int(v) and self.low <= v <= self.high for v in value))
        elif self.kind == INT:
            valid = is_int(value) and self.low <= value <= self.high
        else:
            valid = ((is_int(value) or (isinstance(value, float) and math.isfinite(value)))
                     and self.low <= value <= self.high)
        if valid:
            return None
        return f"'{self.key}' must be {self.describe()}, got {shown(value)}"

    def check(self, metrics: Mapping[str, object]) -> str | None:
        if self.key not in metrics:
            return f"missing {self.key}" if self.required else None
        return self.problem(metrics[self.key])

    def read(self, metrics: Mapping[str, object] | None) -> object | None:
        """The metric's value when present and valid, else ``None``."""
        if metrics is None or self.key not in metrics:
            return None
        value = metrics[self.key]
        return value if self.problem(value) is None else None


@dataclass(frozen=True)
class Within:
    """Two counts that come together, the first at most the second (correct
    predictions of examples)."""

    part: str
    whole: str

    def check(self, metrics: Mapping[str, object]) -> str | None:
        present = (self.part in metrics, self.whole in metrics)
        if present == (False, False):
            return None
        if present != (True, True):
            return f"'{self.part}' and '{self.whole}' come together or not at all"
        if metrics[self.part] > metrics[self.whole]:
            return (f"'{self.part}' is {metrics[self.part]}, more than '{self.whole}' "
                    f"{metrics[self.whole]}")
        return None


# Arrays the checks decoded, by the id of their Array (with a weak reference that
# drops the entry when the reply is gone): what reply_arrays hands the aggregation.
_DECODED: dict[int, tuple[weakref.ref, np.ndarray]] = {}


def _keep_decoded(array: Array, value: np.ndarray) -> None:
    key = id(array)
    _DECODED[key] = (weakref.ref(array, lambda _, key=key: _DECODED.pop(key, None)), value)


def decoded(array: Array) -> np.ndarray:
    """``array``'s ndarray as a check decoded it, or decoded now (a copy)."""
    kept = _DECODED.get(id(array))
    if kept is not None and kept[0]() is array:
        return kept[1]
    return array.numpy()


def reply_arrays(message: Message, name: str) -> ArrayDict:
    """The arrays of a checked reply's ArrayRecord ``name`` by key, as its check decoded
    them: read-only views of the reply's bytes, so a reply is decoded once however
    often the strategy reads it (an array no check decoded is decoded now)."""
    record = message.content.array_records[name]
    return {key: decoded(array) for key, array in record.items()}


def decode_array(array: object, reference: np.ndarray) -> tuple[np.ndarray | None, str]:
    """The ndarray an uploaded ``Array`` holds, when it has ``reference``'s dtype and
    shape and only finite entries within ±:data:`MAX_ARRAY_VALUE`; else ``None`` and
    why not.

    The .npy header is read before any data: a header that declares another dtype or
    shape (a huge one, an object array) is refused without allocating anything. The
    value is a read-only view of the Array's bytes (no copy), kept for
    :func:`reply_arrays`.
    """
    if not isinstance(array, Array):
        return None, f"is a {type(array).__name__}, not an Array"
    if array.stype != "numpy.ndarray" or not isinstance(array.data, bytes):
        return None, f"is not a serialized numpy array (stype {one_line(array.stype, 40)!r})"
    stream = BytesIO(array.data)
    try:  # numpy's parser of the header, on untrusted bytes: any failure is a bad reply
        version = np.lib.format.read_magic(stream)
        if version not in NPY_VERSIONS:
            return None, f"is in .npy format {version}, not 1.0 or 2.0"
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, fortran_order, dtype = read_header(stream)
    except Exception as error:
        return None, f"is not a readable .npy array ({one_line(error, 80)})"
    if not all(type(size) is int for size in shape):  # (True,) == (1,) to numpy's parser
        return None, f"has a shape of non-integer sizes {shown(shape)}"
    if dtype != reference.dtype:
        return None, f"has dtype {dtype}, expected {reference.dtype}"
    if tuple(shape) != reference.shape:
        return None, f"has shape {tuple(shape)}, expected {reference.shape}"
    if len(array.data) - stream.tell() != reference.nbytes:
        return None, (f"holds {len(array.data) - stream.tell()} bytes of data, "
                      f"its shape and dtype {reference.nbytes}")
    value = np.frombuffer(array.data, dtype=dtype, count=reference.size,
                          offset=stream.tell()).reshape(shape, order="F" if fortran_order
                                                        else "C")
    if value.size:
        low, high = value.min(), value.max()
        if not (np.isfinite(low) and np.isfinite(high)):
            return None, "holds non-finite values"
        if low < -MAX_ARRAY_VALUE or high > MAX_ARRAY_VALUE:
            return None, f"holds values beyond ±{_bound(MAX_ARRAY_VALUE)}"
    _keep_decoded(array, value)
    return value, ""


def check_arrays(name: str, record: ArrayRecord,
                 references: Mapping[str, np.ndarray]) -> str | None:
    """Why the ArrayRecord ``name`` does not hold exactly ``references``' keys, each
    with its dtype and shape and usable values (``None``: it does)."""
    keys, expected = set(record.keys()), set(references)
    if keys != expected:
        return (f"the '{name}' arrays do not match the expected keys (unexpected: "
                f"{_names(keys - expected)}, missing: {_names(expected - keys)})")
    for key, reference in references.items():
        _, problem = decode_array(record[key], np.asarray(reference))
        if problem:
            return f"{key!r} {problem}" if name == ARRAYS else f"{name} {key!r} {problem}"
    return None


@dataclass(frozen=True)
class ReplySchema:
    """Everything the server reads from one kind of reply.

    Parameters
    ----------
    metrics : tuple[Metric, ...]
        The metrics of the ``metrics`` record the server reads.
    rules : tuple[Within, ...] (default: ())
        Pairs of counts checked together.
    arrays : Mapping[str, Mapping[str, np.ndarray]] (default: none)
        The ArrayRecords the reply must hold, by name, each with the arrays (by key)
        whose dtypes and shapes its arrays must have.
    """

    metrics: tuple[Metric, ...]
    rules: tuple[Within, ...] = ()
    arrays: Mapping[str, Mapping[str, np.ndarray]] = field(default_factory=dict)

    def check(self, message: Message) -> str | None:
        """Why the reply is unusable (one line), or ``None`` when every field the
        server reads is there and valid."""
        if message.has_error():
            return f"client error: {one_line(message.error.reason, ERROR_LENGTH, tail=True)}"
        content = message.content
        reason = self._check_records(content)
        if reason is None:
            metrics = content.metric_records[METRICS]
            reason = next((r for r in (m.check(metrics) for m in self.metrics) if r), None)
            reason = reason or next((r for r in (w.check(metrics) for w in self.rules)
                                     if r), None)
        for name, references in self.arrays.items():
            if reason is not None:
                break
            reason = check_arrays(name, content.array_records[name], references)
        return reason

    def _check_records(self, content) -> str | None:
        """The reply holds one MetricRecord ``metrics``, the ArrayRecords of the schema
        and nothing else."""
        expected = {**dict.fromkeys(self.arrays, ArrayRecord), METRICS: MetricRecord}
        for name, kind in expected.items():
            views = content.array_records if kind is ArrayRecord else content.metric_records
            if name not in views:
                return f"no {kind.__name__} '{name}' in the reply"
        extra = set(content.keys()) - set(expected)
        if extra:
            return f"unexpected records in the reply: {_names(extra)}"
        return None

    def fields(self) -> list[str]:
        """The record names and metric keys this schema reads (for the docs' test)."""
        return [*self.arrays, METRICS, *(m.key for m in self.metrics)]


def partition_metric(num_partitions: int) -> Metric:
    return Metric(PARTITION_ID, INT, 0, num_partitions - 1, required=True)


TIMING_METRICS = tuple(Metric(key, NUMBER, 0, MAX_SECONDS) for key in TIMINGS)
STARTUP_METRICS = tuple(Metric(key, NUMBER, 0, MAX_EPOCH) for key in (
    PROCESS_STARTED_AT, HANDLER_STARTED_AT, APP_IMPORT_STARTED_AT, APP_IMPORTED_AT))
STARTUP = {metric.key: metric for metric in STARTUP_METRICS}


def train_schema(shared: Mapping[str, np.ndarray], num_partitions: int, *,
                 steps_required: bool = False,
                 reference_change: Mapping[str, np.ndarray] | None = None,
                 clipping_bit: bool = False) -> ReplySchema:
    """A training reply: the shared block as broadcast (``shared``), the partition, the
    images and the optional figures of a round; FedSPC needs the shared steps E_k
    (``steps_required``) and, uploaded explicitly, the reference change with u_bar's
    keys, dtype and shapes (``reference_change``); adaptive clipping on the clients
    the bit b_k = 1[‖Δ_k‖ ≤ C_t] (``clipping_bit``: an integer 0 or 1, required)."""
    arrays = {ARRAYS: shared}
    if reference_change is not None:
        arrays[REFERENCE_CHANGE] = reference_change
    return ReplySchema(
        metrics=(
            partition_metric(num_partitions),
            Metric(NUM_EXAMPLES, INT, 1, MAX_COUNT, required=True),
            Metric(SHARED_STEPS, INT, 1 if steps_required else 0, MAX_COUNT,
                   required=steps_required),
            *((Metric(WITHIN_CLIPPING_NORM, INT, 0, 1, required=True),)
              if clipping_bit else ()),
            Metric(TRAIN_LOSS, NUMBER, 0, MAX_NUMBER),
            Metric(EXAMPLES_SEEN, INT, 0, MAX_COUNT),
            Metric(ROUNDS_TRAINED, INT, 0, MAX_COUNT),
            Metric(LOCAL_CORRECT, INT, 0, MAX_COUNT),
            Metric(LOCAL_EXAMPLES, INT, 1, MAX_COUNT),
            *TIMING_METRICS,
            *STARTUP_METRICS,
        ),
        rules=(Within(LOCAL_CORRECT, LOCAL_EXAMPLES),),
        arrays=arrays,
    )


def evaluate_schema(num_partitions: int) -> ReplySchema:
    """An evaluation reply (of a training or a held-out client): its test counts and
    loss, the partition, and the optional global-model counts and timings."""
    return ReplySchema(
        metrics=(
            partition_metric(num_partitions),
            Metric(NUM_EXAMPLES, INT, 1, MAX_COUNT, required=True),
            Metric(CORRECT, INT, 0, MAX_COUNT, required=True),
            Metric(LOSS_SUM, NUMBER, 0, MAX_NUMBER, required=True),
            Metric(GLOBAL_CORRECT, INT, 0, MAX_COUNT),
            Metric(GLOBAL_EXAMPLES, INT, 1, MAX_COUNT),
            *TIMING_METRICS,
            *STARTUP_METRICS,
        ),
        rules=(Within(CORRECT, NUM_EXAMPLES), Within(GLOBAL_CORRECT, GLOBAL_EXAMPLES)),
    )


def node_answer_schema(num_partitions: int) -> ReplySchema:
    """A node's answer to the partition query or the warm-up: its partition id (and
    the warm-up's start-up times)."""
    return ReplySchema(metrics=(partition_metric(num_partitions), *STARTUP_METRICS))


def partition_report_schema(num_partitions: int, num_classes: int) -> ReplySchema:
    """A deployment node's preflight report: its partition id and per-class counts."""
    counts = dict(kind=INT_LIST, low=0, high=MAX_COUNT, required=True, length=num_classes)
    return ReplySchema(metrics=(
        partition_metric(num_partitions),
        Metric("train-counts", **counts),
        Metric("test-counts", **counts),
        Metric("tries", INT, 0, MAX_COUNT, required=True),
        Metric("durable-state", INT, 0, 1, required=True),
    ))
