"""FedAvg over the shared block of a personalized model.

The server only ever holds the shared state-dict entries of the method; replies
are checked key by key (a reply carrying a key outside the shared set, a wrong
shape or a non-finite value is rejected with a logged reason) and averaged with
the paper's unweighted mean (or sample-weighted, as an option). Evaluation
replies are aggregated into the paper's personalized accuracy: the mean over
clients of each client's accuracy on its own test split.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from logging import INFO, WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from fedspc_app.core.errors import FedSPCError
from fedspc_app.core.task import ArrayDict, from_record, to_record

ARRAYS = "arrays"
METRICS = "metrics"

RoundCallback = Callable[[int, MetricRecord | None, MetricRecord | None], None]


class NoValidReplies(FedSPCError):
    """Every client of a round failed or sent an unusable reply."""


def mean_arrays(updates: Sequence[ArrayDict], weights: Sequence[float]) -> ArrayDict:
    """Weighted mean of ``updates`` key by key, accumulated in float64.

    Each result keeps the dtype of the inputs; integer entries (BatchNorm's
    ``num_batches_tracked``) are rounded rather than turned into floats.
    """
    total = float(sum(weights))
    out: ArrayDict = {}
    for key, first in updates[0].items():
        acc = np.zeros(np.shape(first), dtype=np.float64)
        for update, weight in zip(updates, weights):
            acc += np.asarray(update[key], dtype=np.float64) * (weight / total)
        if np.issubdtype(first.dtype, np.integer):
            out[key] = np.rint(acc).astype(first.dtype)
        else:
            out[key] = acc.astype(first.dtype)
    return out


class PersonalizedFedAvg(FedAvg):
    """Average the shared block; personalized entries never reach the server.

    Parameters
    ----------
    shared_keys : Sequence[str]
        State-dict keys the method shares (the Table 2 split). Replies must carry
        exactly these keys.
    aggregation : {"mean", "weighted"} (default: "mean")
        ``mean``: the paper's unweighted mean over the sampled clients;
        ``weighted``: weighted by each reply's ``num-examples``.
    fraction_train : float (default: 1.0)
        Fraction of the connected clients sampled each round.
    min_available_nodes : int (default: 2)
        Wait until this many clients are connected before sampling.
    on_round_end : callable, optional
        Called as ``on_round_end(server_round, train_metrics, evaluate_metrics)``
        after each round's evaluation (progress output and results files).
    """

    def __init__(
        self,
        *,
        shared_keys: Sequence[str],
        aggregation: str = "mean",
        fraction_train: float = 1.0,
        min_available_nodes: int = 2,
        on_round_end: RoundCallback | None = None,
    ) -> None:
        super().__init__(
            fraction_train=fraction_train,
            fraction_evaluate=1.0,
            min_train_nodes=1,
            min_evaluate_nodes=1,
            min_available_nodes=min_available_nodes,
        )
        if aggregation not in ("mean", "weighted"):
            raise ValueError(f"aggregation must be 'mean' or 'weighted', got {aggregation!r}")
        self.shared_keys = tuple(shared_keys)
        self.aggregation = aggregation
        self.on_round_end = on_round_end
        self.broadcast: ArrayDict | None = None
        self.last_train_metrics: MetricRecord | None = None

    def summary(self) -> None:
        log(INFO, "\t├──> Shared keys: %d (aggregation: %s)", len(self.shared_keys),
            self.aggregation)
        super().summary()

    # ------------------------------------------------------------------ training
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample clients and send them the shared block."""
        if set(arrays.keys()) != set(self.shared_keys):
            raise ValueError("the broadcast must hold exactly the shared keys")
        self.broadcast = from_record(arrays)
        return super().configure_train(server_round, arrays, config, grid)

    def check_reply(self, message: Message) -> str | None:
        """Why a train reply is unusable, or ``None`` when it is fine."""
        if message.has_error():
            return f"client error: {message.error.reason}"
        content = message.content
        if ARRAYS not in content.array_records:
            return f"no ArrayRecord '{ARRAYS}' in the reply"
        if METRICS not in content.metric_records:
            return f"no MetricRecord '{METRICS}' in the reply"
        record = content.array_records[ARRAYS]
        keys = set(record.keys())
        expected = set(self.shared_keys)
        if keys != expected:
            extra, missing = sorted(keys - expected), sorted(expected - keys)
            return (f"reply arrays do not match the shared keys "
                    f"(unexpected: {extra[:3]}, missing: {missing[:3]})")
        for key, array in record.items():
            value = array.numpy()
            reference = self.broadcast[key]
            if value.shape != reference.shape:
                return f"{key!r} has shape {value.shape}, expected {reference.shape}"
            if np.issubdtype(value.dtype, np.floating) and not np.all(np.isfinite(value)):
                return f"{key!r} holds non-finite values"
        num_examples = content.metric_records[METRICS].get("num-examples")
        if not isinstance(num_examples, int) or num_examples <= 0:
            return f"'num-examples' must be a positive integer, got {num_examples!r}"
        return None

    def accept_replies(self, server_round: int, replies: Iterable[Message],
                       check: Callable[[Message], str | None] | None = None) -> list[Message]:
        """Keep the usable replies, log why the others were dropped.

        Raises :class:`NoValidReplies` when none is usable: continuing with an
        unchanged model would silently waste the run.
        """
        replies = list(replies)
        accepted, reasons = [], []
        for message in replies:
            reason = self.check_reply(message) or (check(message) if check else None)
            if reason is None:
                accepted.append(message)
            else:
                node = message.metadata.src_node_id
                reasons.append(f"node {node}: {reason}")
                log(WARNING, "round %d: dropped the reply of node %d: %s", server_round,
                    node, reason)
        if not accepted:
            raise NoValidReplies(
                f"round {server_round}: no usable training reply out of {len(replies)}: "
                + "; ".join(reasons[:5])
            )
        return accepted

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Average the shared block over the accepted replies."""
        accepted = self.accept_replies(server_round, replies)
        return self.aggregate_accepted(server_round, accepted)

    def aggregate_accepted(
        self, server_round: int, accepted: Sequence[Message]
    ) -> tuple[ArrayRecord, MetricRecord]:
        """Aggregate replies that already passed :meth:`check_reply`."""
        updates = [from_record(m.content.array_records[ARRAYS]) for m in accepted]
        metrics = [m.content.metric_records[METRICS] for m in accepted]
        if self.aggregation == "weighted":
            weights = [float(m["num-examples"]) for m in metrics]
        else:
            weights = [1.0] * len(updates)
        arrays = mean_arrays(updates, weights)
        losses = [float(m["train-loss"]) for m in metrics if "train-loss" in m]
        summary = MetricRecord({
            "clients": len(accepted),
            "train-loss": float(np.mean(losses)) if losses else float("nan"),
            "num-examples": int(sum(int(m["num-examples"]) for m in metrics)),
            "examples-seen": int(sum(int(m.get("examples-seen", 0)) for m in metrics)),
            # Rounds each client has completed, as its persisted state says.
            "min-rounds-trained": int(min(int(m.get("rounds-trained", 0)) for m in metrics)),
        })
        self.last_train_metrics = summary
        return to_record(arrays), summary

    # ---------------------------------------------------------------- evaluation
    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Personalized accuracy (mean over clients), weighted accuracy, per client."""
        rows = []
        for message in replies:
            if message.has_error():
                log(WARNING, "round %d: evaluation failed on node %d: %s", server_round,
                    message.metadata.src_node_id, message.error.reason)
                continue
            metrics = message.content.metric_records.get(METRICS)
            if metrics is None or int(metrics.get("num-examples", 0)) <= 0:
                log(WARNING, "round %d: unusable evaluation reply from node %d",
                    server_round, message.metadata.src_node_id)
                continue
            rows.append((int(metrics["partition-id"]), int(metrics["correct"]),
                         int(metrics["num-examples"]), float(metrics["loss-sum"])))
        result = None
        if rows:
            rows.sort()
            accuracies = [correct / n for _, correct, n, _ in rows]
            total = sum(n for _, _, n, _ in rows)
            result = MetricRecord({
                "accuracy": float(np.mean(accuracies)),
                "weighted-accuracy": sum(c for _, c, _, _ in rows) / total,
                "loss": sum(loss for *_, loss in rows) / total,
                "clients": len(rows),
                "client-ids": [pid for pid, *_ in rows],
                "client-accuracy": accuracies,
                "client-examples": [n for _, _, n, _ in rows],
            })
        if self.on_round_end is not None:
            self.on_round_end(server_round, self.last_train_metrics, result)
        return result
