"""What the server reports of a round's replies: the accuracies the clients send (after
aggregation, before it, of the global model), their summed timings, and the paper's
personalized accuracy over the evaluated clients. Reply values reach these only after
the reply checks of :mod:`fedspc_app.core.replies`."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from flwr.app import MetricRecord

from fedspc_app.core.protocol import (
    GLOBAL_CORRECT,
    GLOBAL_EXAMPLES,
    LOCAL_CORRECT,
    LOCAL_EXAMPLES,
    TIMINGS,
)


def optional_accuracy(metrics: Sequence[MetricRecord], correct: str, examples: str,
                      name: str) -> dict[str, float | list]:
    """``name`` (the mean over clients) and ``client-<name>`` (each reply's, in order)
    of an optional pair of reply counts; empty unless every reply reports a valid one."""
    usable = [m for m in metrics
              if isinstance(m.get(correct), int) and isinstance(m.get(examples), int)
              and 0 <= m[correct] <= m[examples] and m[examples] > 0]
    if not metrics or len(usable) != len(metrics):
        return {}
    accuracies = [m[correct] / m[examples] for m in usable]
    return {name: float(np.mean(accuracies)), f"client-{name}": accuracies}


def accuracy_before_aggregation(metrics: Sequence[MetricRecord]) -> dict[str, float | list]:
    """The accuracy of each client's locally trained model (``evaluate-before-aggregation``)."""
    return optional_accuracy(metrics, LOCAL_CORRECT, LOCAL_EXAMPLES,
                             "accuracy-before-aggregation")


def global_model_accuracy(metrics: Sequence[MetricRecord]) -> dict[str, float | list]:
    """The received global model's accuracy on each client's test split, beside a
    personal model's (``evaluate-global-model``)."""
    return optional_accuracy(metrics, GLOBAL_CORRECT, GLOBAL_EXAMPLES, "global-accuracy")


def summed_timings(metrics: Iterable[MetricRecord]) -> dict[str, float]:
    """``client-<timing>``: the sum over the replies of each timing they report."""
    totals = dict.fromkeys(TIMINGS, 0.0)
    for record in metrics:
        for key in TIMINGS:
            value = record.get(key, 0.0)
            if isinstance(value, (int, float)) and math.isfinite(value) and value > 0:
                totals[key] += float(value)
    return {f"client-{key}": value for key, value in totals.items()}


def evaluation_summary(rows: Mapping[int, tuple[int, int, float]]) -> dict[str, float | list]:
    """The paper's personalized accuracy and its companions, from each evaluated
    client's ``(correct, examples, loss sum)`` by partition id.

    ``accuracy`` is the mean over clients of each one's accuracy on its own test
    split; ``weighted-accuracy`` and ``loss`` are over all the test images; the
    ``client-*`` lists follow ``client-ids`` (ascending partition ids).
    """
    ids = sorted(rows)
    accuracies = [rows[pid][0] / rows[pid][1] for pid in ids]
    total = sum(rows[pid][1] for pid in ids)
    return {
        "accuracy": float(np.mean(accuracies)),
        "weighted-accuracy": sum(rows[pid][0] for pid in ids) / total,
        "loss": sum(rows[pid][2] for pid in ids) / total,
        "clients": len(ids),
        "client-ids": ids,
        "client-accuracy": accuracies,
        "client-examples": [rows[pid][1] for pid in ids],
    }
