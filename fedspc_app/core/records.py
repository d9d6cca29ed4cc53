"""Arrays by key, and their Flower ArrayRecords (numpy and flwr only, no torch).

Messages, the clients' saved state and checkpoints carry arrays as ``{key: ndarray}``
dicts; these convert them to and from ArrayRecords, always by key, never by position.
:func:`reply_metrics` reads a reply's metrics record.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord

from fedspc_app.core.protocol import METRICS

ArrayDict = dict[str, np.ndarray]


def to_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """An ArrayRecord holding ``arrays`` under their keys."""
    # np.ascontiguousarray would turn 0-d arrays (BatchNorm's num_batches_tracked) into 1-d.
    return ArrayRecord({key: Array(np.require(value, requirements="C"))
                        for key, value in arrays.items()})


def from_record(record: ArrayRecord) -> ArrayDict:
    """The arrays of an ArrayRecord as a ``{key: ndarray}`` dict."""
    return {key: array.numpy() for key, array in record.items()}


def reply_metrics(reply: Message) -> MetricRecord | None:
    """A reply's metrics record, or None for an error reply or one without it."""
    if reply.has_error() or METRICS not in reply.content.metric_records:
        return None
    return reply.content.metric_records[METRICS]
