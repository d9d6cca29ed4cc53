"""FedSPC's server side: a wrapper that keeps the global drift reference u_bar.

``FedSPC(inner)`` wraps the strategy of any method whose clients upload their
final shared parameters. It adds ``u_bar^t`` to every training message (Algorithm
1, step 1), lets the inner strategy aggregate the shared parameters (step 4,
``theta_s^{t+1} = theta_s^t + mean_k Delta theta_k``), and updates
``u_bar^{t+1} = u_bar^t + (1/K) sum_{k in S_t} (u_k^{t+1} - u_k^t)`` with K the
total number of clients, so partial participation works.

The reference change of client k is ``-u_bar^t - Delta theta_k / (E_k eta)``, a
deterministic function of what the server already has. By default
(``upload="derived"``) clients upload only their shared parameters and the number
of shared steps E_k, and the server derives the change with the same function the
client uses (:mod:`fedspc_app.core.correction`), so FedSPC costs no extra upload bytes;
``upload="explicit"`` makes clients also send the change, as the paper describes.
Both give identical parameters.

SCAFFOLD is this wrapper with every parameter shared.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from logging import INFO

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from fedspc_app.core.correction import reference_change, shared_update
from fedspc_app.core.protocol import (
    ARRAYS,
    GLOBAL_REFERENCE,
    METRICS,
    REFERENCE_CHANGE,
    REFERENCE_UPLOAD,
    SHARED_STEPS,
)
from fedspc_app.core.records import ArrayDict, from_record, to_record
from strategies.personalized import PersonalizedFedAvg


class FedSPC(Strategy):
    """Shared-parameter correction around a personalized strategy.

    Parameters
    ----------
    strategy : PersonalizedFedAvg
        The method's strategy; it aggregates the shared parameters.
    corrected_keys : Sequence[str]
        The shared trainable parameters (keys of u_k and u_bar); shared buffers
        such as BatchNorm statistics are averaged but not corrected.
    learning_rate : float
        The clients' local learning rate eta.
    upload : {"derived", "explicit"} (default: "derived")
        Whether clients upload their reference change or the server derives it.
    """

    def __init__(
        self,
        strategy: PersonalizedFedAvg,
        *,
        corrected_keys: Sequence[str],
        learning_rate: float,
        upload: str = "derived",
    ) -> None:
        if upload not in ("derived", "explicit"):
            raise ValueError(f"upload must be 'derived' or 'explicit', got {upload!r}")
        missing = set(corrected_keys) - set(strategy.shared_keys)
        if missing:
            raise ValueError(f"corrected keys outside the shared block: {sorted(missing)[:3]}")
        self.strategy = strategy
        self.corrected_keys = tuple(corrected_keys)
        self.learning_rate = float(learning_rate)
        self.upload = upload
        self.global_reference: ArrayDict | None = None
        self.num_clients = 0
        self.broadcast: ArrayDict | None = None

    def summary(self) -> None:
        log(INFO, "\t├──> FedSPC: %d corrected keys, eta=%g, reference change %s",
            len(self.corrected_keys), self.learning_rate, self.upload)
        self.strategy.summary()

    # ------------------------------------------------------------------ state
    @property
    def report(self):
        return self.strategy.report

    @property
    def durable_through(self) -> int:
        return self.strategy.durable_through

    @durable_through.setter
    def durable_through(self, server_round: int) -> None:
        self.strategy.durable_through = server_round

    @property
    def fraction_evaluate(self) -> float:
        return self.strategy.fraction_evaluate

    @fraction_evaluate.setter
    def fraction_evaluate(self, fraction: float) -> None:
        self.strategy.fraction_evaluate = fraction

    @property
    def run_token(self) -> str:
        return self.strategy.run_token

    @run_token.setter
    def run_token(self, token: str) -> None:
        self.strategy.run_token = token

    def state_dict(self) -> dict:
        return {**self.strategy.state_dict(), "num-clients": self.num_clients}

    def state_arrays(self) -> ArrayDict:
        """u_bar, for a checkpoint (empty before round 1)."""
        return dict(self.global_reference or {})

    def load_state_dict(self, state: dict, completed_round: int,
                        global_reference: ArrayDict | None = None) -> None:
        self.strategy.load_state_dict(state, completed_round)
        self.num_clients = int(state.get("num-clients", 0))
        if global_reference:
            if set(global_reference) != set(self.corrected_keys):
                raise ValueError("the checkpoint's u_bar does not cover the corrected keys")
            self.global_reference = {key: np.asarray(value, dtype=np.float32)
                                     for key, value in global_reference.items()}

    # ------------------------------------------------------------------ training
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Broadcast theta_s^t and u_bar^t (Algorithm 1, step 1)."""
        self.broadcast = from_record(arrays)
        if self.global_reference is None:  # u_bar^0 = 0
            self.global_reference = {
                key: np.zeros_like(self.broadcast[key], dtype=np.float32)
                for key in self.corrected_keys
            }
        config[REFERENCE_UPLOAD] = self.upload
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        # K: every client of the run, sampled, connected or not (u_bar is their mean u_k).
        self.num_clients = self.strategy.num_partitions
        reference = to_record(self.global_reference)
        for message in messages:
            message.content[GLOBAL_REFERENCE] = reference
        return messages

    def check_reply(self, message: Message) -> str | None:
        """FedSPC's own requirements on a reply (the inner strategy checks the rest)."""
        if message.has_error():
            return None  # reported by the inner check
        metrics = message.content.metric_records.get(METRICS)
        steps = metrics.get(SHARED_STEPS) if metrics is not None else None
        if not isinstance(steps, int) or steps <= 0:
            return f"'{SHARED_STEPS}' must be a positive integer, got {steps!r}"
        if self.upload == "explicit":
            record = message.content.array_records.get(REFERENCE_CHANGE)
            if record is None:
                return f"no ArrayRecord '{REFERENCE_CHANGE}' in the reply"
            if set(record.keys()) != set(self.corrected_keys):
                return "the reference change does not cover exactly the corrected keys"
            for key, array in record.items():
                value = array.numpy()
                if value.shape != self.global_reference[key].shape:
                    return f"reference change {key!r} has shape {value.shape}"
                if not np.all(np.isfinite(value)):
                    return f"reference change {key!r} holds non-finite values"
        return None

    def reference_change_of(self, message: Message) -> ArrayDict:
        """``u_k^{t+1} - u_k^t`` of one accepted reply (uploaded or derived)."""
        if self.upload == "explicit":
            return from_record(message.content.array_records[REFERENCE_CHANGE])
        final = from_record(message.content.array_records[ARRAYS])
        update = shared_update(final, self.broadcast, self.corrected_keys)
        steps = int(message.content.metric_records[METRICS][SHARED_STEPS])
        return reference_change(update, self.global_reference, steps=steps,
                                learning_rate=self.learning_rate)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate theta_s with the inner strategy, then update u_bar (step 4)."""
        accepted = self.strategy.accept_replies(server_round, replies, self.check_reply)
        if not accepted:  # the round failed: theta_s and u_bar stay as they were
            return None, None
        arrays, metrics = self.strategy.aggregate_accepted(server_round, accepted)
        total = {key: np.zeros(value.shape, dtype=np.float64)
                 for key, value in self.global_reference.items()}
        for message in accepted:
            for key, value in self.reference_change_of(message).items():
                total[key] += value
        num_clients = max(self.num_clients, len(accepted))
        self.global_reference = {
            key: (self.global_reference[key] + total[key] / num_clients).astype(np.float32)
            for key in self.global_reference
        }
        norm = float(np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2))
                                 for v in self.global_reference.values())))
        metrics["global-reference-norm"] = norm
        return arrays, metrics

    # ---------------------------------------------------------------- evaluation
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)
