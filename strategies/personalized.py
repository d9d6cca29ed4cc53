"""FedAvg over the shared block of a personalized model.

The server only ever holds the shared state-dict entries of the method; replies
are checked against their schema before anything in them is used
(:mod:`fedspc_app.core.replies`: records, keys, dtypes, shapes, finite bounded
values, every metric's type and range) and against the partition their node is
bound to (a node replies for its own partition only); a reply that fails is
dropped with a one-line reason. The usable ones are averaged with
the paper's unweighted mean (or sample-weighted, as an option). A round in which
fewer than ``min_train_replies`` of the sampled clients sent a usable reply fails:
the shared block stays as it was (not under differential privacy: see
:meth:`PersonalizedFedAvg.accept_replies`). Every message tells the clients which of
their replies went into an aggregate (``accepted-rounds``), so they commit or discard
the state they staged (:mod:`clients.state`). Evaluation replies are validated
the same way and aggregated into the paper's personalized accuracy: the mean over
clients of each client's accuracy on its own test split.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from fedspc_app.core.dp_mechanism import new_secret, update_norm
from fedspc_app.core.errors import FedSPCError
from fedspc_app.core.protocol import (
    ACCEPTED_ROUNDS,
    ARRAYS,
    CLIPPING_NORM,
    CORRECT,
    DURABLE_THROUGH,
    EXAMPLES_SEEN,
    HELD_OUT,
    LOSS_SUM,
    METRICS,
    NUM_EXAMPLES,
    PARTITION_ID,
    ROUND_LEARNING_RATE,
    ROUNDS_TRAINED,
    RUN_TOKEN,
    SERVER_ROUND,
    SHARED_STEPS,
    TRAIN_LOSS,
    WITHIN_CLIPPING_NORM,
)
from fedspc_app.core.records import ArrayDict, from_record, to_record
from fedspc_app.core.replies import (
    ReplySchema,
    evaluate_schema,
    one_line,
    reply_arrays,
    train_schema,
)
from strategies.aggregation import AggregationRule, mean_arrays
from strategies.dp_release import Privacy, PrivateRelease, ReleaseError, unmoved
from strategies.drift import drift_statistics
from strategies.sampling import PartitionSampler
from strategies.server_optimizer import ServerOptimizer
from strategies.summaries import (
    accuracy_before_aggregation,
    evaluation_summary,
    global_model_accuracy,
    summed_timings,
)

DP_SECRET = "dp-secret"  # the checkpoint's key of the privacy secret
# How far, relatively, a client-clipped update's norm may exceed C_t (float rounding).
CLIPPING_TOLERANCE = 1e-4
# Under differential privacy a round's one reason, whatever was dropped or missing:
# which replies, how many and why would tell who and how many were drawn.
PRIVATE_DROPPED = ("replies of drawn clients were dropped or did not come (which, how "
                   "many and why is withheld under differential privacy)")


@dataclass
class RoundReport:
    """What happened to one round's training replies."""

    server_round: int
    sampled: int
    accepted: int = 0
    reasons: list[str] = field(default_factory=list)
    failed: bool = False
    evaluate_dropped: int = 0
    # Differential privacy: how many clients a round drew, and so how many dropped,
    # is not written (with colluders' own draws, the count tells another's).
    private: bool = False

    @property
    def dropped(self) -> int:
        return self.sampled - self.accepted


class PersonalizedFedAvg(FedAvg):
    """Average the shared block; personalized entries never reach the server.

    Parameters
    ----------
    shared_keys : Sequence[str]
        State-dict keys the method shares (the Table 2 split). Replies must carry
        exactly these keys.
    aggregation : str or AggregationRule (default: "mean")
        ``mean``: the paper's unweighted mean over the sampled clients;
        ``weighted``: weighted by each reply's ``num-examples``; or a robust rule
        (``median``, ``trimmed-mean``, ``krum``, ``multi-krum``: see
        :mod:`strategies.aggregation`).
    fraction_train : float (default: 1.0)
        Fraction of the connected clients sampled each round.
    min_available_nodes : int (default: 2)
        Wait until this many clients are connected before sampling.
    num_partitions : int (default: 0, meaning ``min_available_nodes``)
        K, the number of client partitions (replies name theirs).
    min_train_replies : float (default: 0.0)
        Fraction of the sampled clients whose usable replies a round needs; a
        round with fewer fails and leaves the shared block unchanged (at least
        one usable reply is always needed). Not applied under ``privacy``.
    drift_keys : Sequence[str] | None (default: the floating-point shared keys)
        Keys the drift diagnostics of each round cover (see :mod:`strategies.drift`);
        the ServerApp passes the shared trainable parameters.
    seed : int (default: 0)
        Seeds the draw of each round's clients (see :mod:`strategies.sampling`).
    node_wait : float (default: 120)
        Seconds a round waits for missing clients to connect before it goes on
        with the connected ones.
    server_optimizer : ServerOptimizer | None (default: None)
        A server optimizer stepping the shared trainable parameters from the
        broadcast towards the aggregate (:mod:`strategies.server_optimizer`).
    expected_counts : Mapping[int, tuple[int, int]] | None (default: None)
        Per partition id, the training images and the shared steps its reply must
        report (what its data size and the config imply); a reply that reports
        others is dropped. ``None``: not checked.
    privacy : Privacy | None (default: None)
        Client-level differential privacy: the sum of the (clipped) updates gets
        Gaussian noise and is divided by q·K, and nothing computed from single
        clients' updates is reported (the drift diagnostics are the privatized
        aggregate's norm only). The noise and the training draws (Poisson, at
        ``fraction_train``) come from :attr:`secret`, drawn from the operating
        system's entropy and kept in the checkpoint only.
    learning_rates : Sequence[float] | None (default: None)
        The clients' η of rounds 1, 2, … (``lr-schedule``), sent with each round's
        training messages; ``None``: the run-config's constant η, not sent.
    held_out_clients : int (default: 0)
        N: the last N of the ``num_partitions`` never train and are never sampled
        (a reply from one is dropped); every evaluation also sends them the shared
        block with ``held-out`` set, and their replies make the ``held-out-*``
        metrics, never the personalized accuracy or anything aggregated.
    """

    def __init__(
        self,
        *,
        shared_keys: Sequence[str],
        aggregation: str = "mean",
        fraction_train: float = 1.0,
        min_available_nodes: int = 2,
        num_partitions: int = 0,
        min_train_replies: float = 0.0,
        drift_keys: Sequence[str] | None = None,
        seed: int = 0,
        node_wait: float = 120.0,
        server_optimizer: ServerOptimizer | None = None,
        expected_counts: Mapping[int, tuple[int, int]] | None = None,
        privacy: Privacy | None = None,
        learning_rates: Sequence[float] | None = None,
        held_out_clients: int = 0,
    ) -> None:
        super().__init__(
            fraction_train=fraction_train,
            fraction_evaluate=1.0,
            min_train_nodes=1,
            min_evaluate_nodes=1,
            min_available_nodes=min_available_nodes,
        )
        self.rule = (aggregation if isinstance(aggregation, AggregationRule)
                     else AggregationRule(aggregation))
        self.shared_keys = tuple(shared_keys)
        self.drift_keys = None if drift_keys is None else tuple(drift_keys)
        self.aggregation = self.rule.name
        self.server_optimizer = server_optimizer
        if server_optimizer is not None and not set(server_optimizer.keys) <= set(shared_keys):
            raise ValueError("the server optimizer's keys must be shared keys")
        self.expected_counts = dict(expected_counts) if expected_counts else None
        self.selected: list[int] = []  # the accepted replies the last aggregate used
        self.norm_factors: list[float] = []  # and the factors their norms were bounded by
        self.privacy = privacy
        if privacy is not None and self.rule.name != "mean":
            raise ValueError("differential privacy needs the unweighted mean")
        self.privatized: ArrayDict | None = None  # the last noised mean, before any step
        self.learning_rates = tuple(learning_rates) if learning_rates else None
        self.num_partitions = num_partitions or min_available_nodes
        self.held_out_clients = held_out_clients
        self.min_train_replies = min_train_replies
        self.broadcast: ArrayDict | None = None
        self.accepted_rounds = [0] * self.num_partitions
        self.durable_through = 0
        self.run_token = ""
        self.report: RoundReport | None = None
        self.sampled = 0
        self.sampler = PartitionSampler(self.num_partitions, seed=seed, node_wait=node_wait,
                                        wait_for=min_available_nodes,
                                        held_out=held_out_clients)
        self.secret: int | None = None  # differential privacy's, never sent or logged
        # The releases (and under adaptive clipping C_t): strategies/dp_release.py
        self.release: PrivateRelease | None = None
        if privacy is not None:
            self.use_secret(new_secret())
            self.release = PrivateRelease(privacy, self.expected_clients)

    @property
    def num_training(self) -> int:
        """The clients that train: partitions ``0 … num_training-1``."""
        return self.num_partitions - self.held_out_clients

    @property
    def expected_clients(self) -> float:
        """q·K, the expected number of clients a training round draws (public)."""
        return min(self.fraction_train, 1.0) * self.num_training

    def use_secret(self, secret: int) -> None:
        """Draw the noise and the training clients from ``secret`` (privacy only)."""
        self.secret = secret
        self.sampler.secret = secret

    # ------------------------------------------------------------------ state
    def decisions(self) -> dict[str, list[int] | int]:
        """What every message tells the clients about their earlier replies."""
        return {ACCEPTED_ROUNDS: list(self.accepted_rounds),
                DURABLE_THROUGH: self.durable_through, RUN_TOKEN: self.run_token}

    def state_dict(self) -> dict[str, list[int] | str]:
        """What a checkpoint needs to continue this strategy exactly (under privacy
        the secret: the checkpoint must be kept like a key)."""
        state = {ACCEPTED_ROUNDS: list(self.accepted_rounds), RUN_TOKEN: self.run_token}
        if self.secret is not None:
            state[DP_SECRET] = format(self.secret, "x")
        if self.release is not None:
            state.update(self.release.state_dict())  # adaptive clipping's C_t
        return state

    def state_arrays(self) -> ArrayDict:
        """Arrays a checkpoint needs besides the shared block (none here)."""
        return {}

    def learning_rate_of(self, server_round: int) -> float:
        """The clients' η in ``server_round`` (the schedule's, clamped to its end)."""
        rates = self.learning_rates
        return float(rates[min(max(server_round, 1), len(rates)) - 1])

    def optimizer_arrays(self) -> ArrayDict:
        """The server optimizer's state, for a checkpoint (empty without one)."""
        return self.server_optimizer.state_arrays() if self.server_optimizer else {}

    def load_optimizer_arrays(self, state: Mapping[str, np.ndarray]) -> None:
        if self.server_optimizer is not None:
            self.server_optimizer.load_state_arrays(state)
        elif state:
            raise FedSPCError("the checkpoint holds a server optimizer's state, and this "
                              "run has none (server-optimizer)")

    def load_state_dict(self, state: dict, completed_round: int,
                        global_reference: ArrayDict | None = None) -> None:
        if self.release is not None:  # C_t checked first: a refusal changes nothing
            self.release.load_state_dict(state)
        accepted = [int(v) for v in state[ACCEPTED_ROUNDS]]
        if len(accepted) != self.num_partitions:
            raise FedSPCError(f"the checkpoint holds {len(accepted)} clients, this run "
                              f"{self.num_partitions}")
        self.accepted_rounds = accepted
        self.durable_through = completed_round
        self.run_token = str(state.get(RUN_TOKEN, ""))
        if self.privacy is not None:
            if DP_SECRET in state:
                self.use_secret(int(state[DP_SECRET], 16))
            else:
                log(WARNING, "the checkpoint holds no privacy secret (written before the "
                    "noise was secret): the rounds from here on draw from a new one")

    def summary(self) -> None:
        log(INFO, "\t├──> Shared keys: %d (aggregation: %s, server optimizer: %s)",
            len(self.shared_keys), self.aggregation,
            self.server_optimizer.name if self.server_optimizer else "none")
        super().summary()

    # ------------------------------------------------------------------ training
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample clients and send them the shared block."""
        if set(arrays.keys()) != set(self.shared_keys):
            raise ValueError("the broadcast must hold exactly the shared keys")
        self.broadcast = from_record(arrays)
        config.update(self.decisions())
        if self.learning_rates is not None:
            config[ROUND_LEARNING_RATE] = self.learning_rate_of(server_round)
        if self.privacy is not None and self.privacy.adaptive:
            config[CLIPPING_NORM] = self.release.clipping_norm  # C_t: a release, public
        messages, self.sampled = self._messages(server_round, arrays, config, grid,
                                                self.fraction_train, MessageType.TRAIN)
        return messages

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send the sampled clients the shared block and the decisions of this round;
        and every held-out client the shared block, marked ``held-out``."""
        config.update(self.decisions())
        messages, _ = self._messages(server_round, arrays, config, grid,
                                     self.fraction_evaluate, MessageType.EVALUATE)
        if self.held_out_clients:
            nodes, count = self.sampler.held_out_nodes(grid)
            if len(nodes) < count:
                log(WARNING, "configure_evaluate: %d of %d held-out clients connected",
                    len(nodes), count)
            held = ConfigRecord({**config, HELD_OUT: True, SERVER_ROUND: server_round})
            messages += self._addressed(arrays, held, nodes, MessageType.EVALUATE)
        return messages

    def _addressed(self, arrays: ArrayRecord, config: ConfigRecord, nodes: Sequence[int],
                   kind: str) -> list[Message]:
        """One message per node. Under differential privacy each node's
        ``accepted-rounds`` holds its own partition's entry only (the others 0): who
        took part in a round is what the sampling's amplification keeps secret, and
        a client needs no more than its own entry to settle its staged state."""
        if self.privacy is None:
            record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
            return list(self._construct_messages(record, nodes, kind))
        messages = []
        for node in nodes:
            own = [0] * self.num_partitions
            partition = self.sampler.partition_of.get(node)
            if partition is not None:
                own[partition] = self.accepted_rounds[partition]
            record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key:
                                 ConfigRecord({**config, ACCEPTED_ROUNDS: own})})
            messages += self._construct_messages(record, [node], kind)
        return messages

    def _messages(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                  grid: Grid, fraction: float, kind: str) -> tuple[list[Message], int]:
        """One message per sampled client, and how many clients were drawn."""
        nodes, drawn = self.sampler.sample(grid, server_round, fraction, kind)
        if self.privacy is not None and kind == MessageType.TRAIN:
            log(INFO, "configure_train: drew clients at rate %g of %d (the count is "
                "withheld under differential privacy)", fraction, self.num_training)
        else:
            log(INFO, "configure_%s: sampled %d of %d clients%s", kind, drawn,
                self.num_training,
                f" ({drawn - len(nodes)} not connected)" if len(nodes) < drawn else "")
        config[SERVER_ROUND] = server_round
        messages = self._addressed(arrays, config, nodes, kind)
        if self.privacy is not None and kind == MessageType.TRAIN and messages:
            # Built one after another, each message's created_at would say how many
            # drawn messages were built between two colluders': all get the first's.
            for message in messages[1:]:
                message.metadata.created_at = messages[0].metadata.created_at
        return messages, drawn

    def reply_schema(self) -> ReplySchema:
        """What a train reply of this round must hold (:mod:`fedspc_app.core.replies`):
        the shared block with the broadcast's keys, dtypes and shapes, and the metrics."""
        return train_schema(self.broadcast, self.num_partitions,
                            clipping_bit=self.reports_clipping_bit)

    @property
    def reports_clipping_bit(self) -> bool:
        """Whether a train reply carries b_k = 1[‖Δ_k‖ ≤ C_t] (adaptive clipping on
        the clients; on the server it computes b_k itself)."""
        privacy = self.privacy
        return privacy is not None and privacy.adaptive and not privacy.clip_on_server

    def check_reply(self, message: Message) -> str | None:
        """Why a train reply is unusable, or ``None`` when it is fine: its schema, the
        partition its node is bound to, and the counts its partition implies."""
        if self.broadcast is None:
            return "no round is in progress (nothing was broadcast)"
        reason = (self.reply_schema().check(message) or self._check_partition(message)
                  or self._check_clipping(message))
        if reason is not None:
            return reason
        metrics = message.content.metric_records[METRICS]
        if metrics[PARTITION_ID] >= self.num_training:
            return f"partition {metrics[PARTITION_ID]} is a held-out client, which never trains"
        if self.expected_counts is not None:
            return self._check_counts(metrics)
        return None

    def update_keys(self) -> tuple[str, ...]:
        """The keys an update's norm, clipping and drift diagnostics cover: ``drift_keys``,
        or the floating-point shared keys (a checked reply has the broadcast's dtypes)."""
        if self.drift_keys is not None:
            return self.drift_keys
        return tuple(k for k in self.shared_keys
                     if np.issubdtype(self.broadcast[k].dtype, np.floating))

    def _check_clipping(self, message: Message) -> str | None:
        """Under differential privacy with clipping on the clients, why the
        (schema-checked) reply's update of the released keys is longer than the round's
        C_t (beyond :data:`CLIPPING_TOLERANCE`, float rounding): a client that did not
        clip would move the sum by more than the noise is calibrated for (and could
        spoil the model so that an honest client fails whenever drawn). An honest
        client's update always passes, so the check depends on nothing private."""
        privacy = self.privacy
        if privacy is None or privacy.clip_on_server or self.release is None:
            return None
        bound = self.release.clipping_norm
        keys = self.update_keys()
        if not keys or not math.isfinite(bound):
            return None
        norm = update_norm(reply_arrays(message, ARRAYS),
                           self.broadcast, keys)
        if norm > bound * (1.0 + CLIPPING_TOLERANCE):
            return (f"its update's norm {norm:g} exceeds the clipping norm {bound:g} "
                    "(dp-clipping = client): it was not clipped")
        return None

    def _check_counts(self, metrics: MetricRecord) -> str | None:
        """Why the reply's training images or shared steps are not what its partition's
        size and the config imply (a small reported step count would inflate its
        reference change, and its weight under ``weighted``)."""
        expected = self.expected_counts.get(int(metrics[PARTITION_ID]))
        if expected is None:
            return None
        images, steps = expected
        if metrics[NUM_EXAMPLES] != images:
            return (f"'num-examples' is {metrics[NUM_EXAMPLES]}, its partition holds "
                    f"{images} training images")
        reported = metrics.get(SHARED_STEPS)
        if reported != steps:
            return (f"'{SHARED_STEPS}' is {reported!r}; its data size and the config "
                    f"imply {steps}")
        return None

    def _check_partition(self, message: Message) -> str | None:
        """Why the (schema-checked) reply's partition is not its node's: a node replies
        only for the partition it was bound to before it was messaged
        (:meth:`PartitionSampler.bind`), never for another's."""
        node = message.metadata.src_node_id
        claimed = message.content.metric_records[METRICS][PARTITION_ID]
        bound = self.sampler.partition_of.get(node)
        if bound is None:
            return (f"node {node} is bound to no partition (no answer before training "
                    f"was accepted), yet replies for partition {claimed}")
        if claimed != bound:
            return f"node {node} is bound to partition {bound}, its reply claims {claimed}"
        return None

    def accept_replies(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The usable replies in partition order, or none when there are too few (the round
        fails; never under differential privacy, where their number decides nothing).

        Why each other reply was dropped is logged and kept in :attr:`report`.
        """
        replies = list(replies)
        sampled = max(self.sampled, len(replies))
        report = RoundReport(server_round, sampled, private=self.privacy is not None)
        accepted, partitions, withheld = [], set(), False
        for message in replies:
            reason = self.check_reply(message)
            if reason is None:
                partition = message.content.metric_records[METRICS][PARTITION_ID]
                if partition in partitions:
                    reason = f"a second reply for partition {partition}"
                partitions.add(partition)
            if reason is None:
                accepted.append(message)
            elif report.private:
                # Under differential privacy the log and metrics.json say neither whose
                # reply it was nor why (a client's error text, or a count its partition
                # implies, can name it), nor how many: one reason and at most one
                # warning a round (PRIVATE_DROPPED). Who was drawn stays the server's.
                withheld = True
            else:
                who, reason = f"node {message.metadata.src_node_id}", one_line(reason)
                report.reasons.append(f"{who}: {reason}")
                log(WARNING, "round %d: dropped the reply of %s: %s", server_round, who,
                    reason)
        if report.private and (withheld or sampled > len(replies)):
            report.reasons.append(PRIVATE_DROPPED)
        elif sampled > len(replies):
            report.reasons.append(f"{sampled - len(replies)} sampled client(s) did not "
                                  "reply within the round timeout")
        report.accepted = len(accepted)
        needed = max(1, math.ceil(self.min_train_replies * sampled - 1e-9))
        self.report = report
        if report.private:
            # Under differential privacy the release is the noised sum over q·K whoever
            # replied (an empty draw's too): how many usable replies came decides nothing
            # (min-train-replies is not applied). Had too few failed the round, drawn
            # colluders spoiling their own replies would read from it whether another
            # client was drawn.
            if report.reasons:
                log(WARNING, "round %d: %s", server_round, PRIVATE_DROPPED)
        elif len(accepted) < needed:
            report.failed = True
            report.accepted = 0
            log(WARNING, "round %d failed: %d of %d sampled clients sent a usable reply, %d "
                "needed; the shared block stays as it was", server_round, len(accepted),
                sampled, needed)
            return []
        # Sums of floats depend on their order, and replies arrive in any order: in
        # partition order, the same seed gives bit-identical aggregates.
        return sorted(accepted, key=lambda m: m.content.metric_records[METRICS][PARTITION_ID])

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Average the shared block over the accepted replies (None: the round failed)."""
        accepted = self.accept_replies(server_round, replies)
        if self.privacy is not None:
            # Whoever was drawn and replied, the noised sum over q·K: an empty draw, or a
            # draw whose every reply was unusable, releases the noise alone, as the
            # account assumes (a round that released nothing would tell who was drawn).
            return self.released(server_round, accepted)
        if not accepted:
            return None, None
        shortfall = self.rule.shortfall(len(accepted))
        if shortfall is not None:  # too few replies for the rule to bound f faulty ones
            return self.fail(server_round, shortfall)
        return self.aggregate_accepted(server_round, accepted)

    def fail(self, server_round: int, reason: str) -> tuple[None, None]:
        """Fail the round for ``reason``: nothing aggregated, the block stays."""
        self.report.failed, self.report.accepted = True, 0
        self.report.reasons.append(reason)
        log(WARNING, "round %d failed: %s; the shared block stays as it was",
            server_round, reason)
        return None, None

    def released(self, server_round: int, accepted: Sequence[Message]
                 ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """:meth:`aggregate_accepted` under differential privacy; a release that would
        not be the mechanism's (:class:`ReleaseError`) fails the round instead, with
        no reply accepted, and C_t and the server optimizer's moments (stepped before
        the check that fails) as they were."""
        before = list(self.accepted_rounds)
        clipping_norm, moments = self.release.clipping_norm, self.optimizer_arrays()
        try:
            return self.aggregate_accepted(server_round, accepted)
        except ReleaseError as error:
            self.accepted_rounds = before
            self.release.clipping_norm = clipping_norm
            self.load_optimizer_arrays(moments)
            return self.fail(server_round, str(error))

    def aggregate_accepted(
        self, server_round: int, accepted: Sequence[Message]
    ) -> tuple[ArrayRecord, MetricRecord]:
        """Aggregate replies that already passed :meth:`check_reply`."""
        updates = [reply_arrays(m, ARRAYS) for m in accepted]
        metrics = [m.content.metric_records[METRICS] for m in accepted]
        for record in metrics:
            self.accepted_rounds[int(record[PARTITION_ID])] = server_round
        if self.aggregation == "weighted":
            weights = [float(m[NUM_EXAMPLES]) for m in metrics]
        else:
            weights = [1.0] * len(updates)
        keys = self.update_keys()
        self.norm_factors = [1.0] * len(updates)
        if self.privacy is not None:
            self.selected = list(range(len(updates)))
            arrays = self.private_mean(server_round, updates, keys, metrics)
        elif self.rule.robust:
            # Each update's norm bounded first (robust-norm-bound; factors of 1 if not).
            self.norm_factors, ruled = self.rule.bound_norms(updates, self.broadcast, keys)
            self.selected = self.rule.selected(ruled, keys)
            arrays = self.rule.combine([ruled[i] for i in self.selected],
                                       [weights[i] for i in self.selected])
        else:  # the paper's rule, bit for bit
            self.selected = list(range(len(updates)))
            arrays = mean_arrays(updates, weights)
        if self.server_optimizer is not None and self.broadcast is not None:
            arrays = self.server_optimizer.step(server_round, self.broadcast, arrays)
            if self.privacy is not None and self.privacy.noise_multiplier > 0:
                unmoved(arrays, self.broadcast, keys, "the server optimizer's step")
        drift = {}
        if self.privacy is not None and keys:
            # Only the released aggregate's own norm: per-client figures would leak.
            drift = {"update-norm": update_norm(self.privatized, self.broadcast, keys)}
        elif self.broadcast is not None and keys:  # method "local": nothing to measure
            drift = drift_statistics(self.broadcast, updates, weights, keys)
        robust = {}
        if self.rule.robust:
            robust = {"aggregated-client-ids": [int(metrics[i][PARTITION_ID])
                                                for i in self.selected],
                      "norm-bounded-clients": sum(f < 1.0 for f in self.norm_factors)}
        losses = [float(m[TRAIN_LOSS]) for m in metrics if TRAIN_LOSS in m]
        summary = MetricRecord({
            TRAIN_LOSS: float(np.mean(losses)) if losses else float("nan"),
            **drift,
            **robust,
            **(self.release.metrics() if self.release is not None else {}),
            **self.participants(metrics),
            **({ROUND_LEARNING_RATE: self.learning_rate_of(server_round)}
               if self.learning_rates is not None else {}),
        })
        return to_record(arrays), summary

    def participants(self, metrics: Sequence[MetricRecord]) -> dict[str, float | list]:
        """What the round's summary says of its clients: who they were
        (``train-client-ids``), their images and steps, the fewest rounds any has
        trained, their timings and each one's accuracy before aggregation.

        Under differential privacy only the mean accuracy before aggregation: who was
        drawn is what the sampling's amplification keeps secret, and each of the others
        is a sum of public per-client figures (a partition's size fixes its images and
        steps) from which the draw can be solved, or names its clients."""
        before = accuracy_before_aggregation(metrics)
        if self.privacy is not None:
            return {k: v for k, v in before.items() if not k.startswith("client-")}
        return {
            "clients": len(metrics),
            "train-client-ids": [int(m[PARTITION_ID]) for m in metrics],
            NUM_EXAMPLES: int(sum(int(m[NUM_EXAMPLES]) for m in metrics)),
            EXAMPLES_SEEN: int(sum(int(m.get(EXAMPLES_SEEN, 0)) for m in metrics)),
            # Rounds each client has completed, as its persisted state says.
            "min-rounds-trained": int(min((int(m.get(ROUNDS_TRAINED, 0)) for m in metrics),
                                          default=0)),
            **summed_timings(metrics),
            **before,
        }

    def private_mean(self, server_round: int, updates: Sequence[ArrayDict],
                     keys: Sequence[str],
                     metrics: Sequence[MetricRecord] = ()) -> ArrayDict:
        """The broadcast plus the sum of the m (clipped) updates of ``keys`` with
        Gaussian noise, divided by q·K (:class:`~strategies.dp_release.PrivateRelease`;
        under adaptive clipping the clients' bits in ``metrics`` move C_t); kept in
        :attr:`privatized`. A reply that did not come adds nothing to the sum, so one
        client still moves it by at most C; with every client drawn and replying it
        is their mean."""
        reported = ([int(m[WITHIN_CLIPPING_NORM]) for m in metrics]
                    if self.reports_clipping_bit else ())
        self.privatized = self.release.release(server_round, self.secret, self.broadcast,
                                               updates, keys, reported)
        return self.privatized

    # ---------------------------------------------------------------- evaluation
    def check_evaluation(self, message: Message) -> str | None:
        """Why an evaluation reply is unusable, or ``None`` when it is fine: its schema
        and the partition its node is bound to."""
        return (evaluate_schema(self.num_partitions).check(message)
                or self._check_partition(message))

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Personalized accuracy (mean over clients), weighted accuracy, per client;
        the held-out clients' as ``held-out-<key>``."""
        rows, records, dropped = {}, {}, 0
        for message in replies:
            reason = self.check_evaluation(message)
            if reason is None:
                metrics = message.content.metric_records[METRICS]
                partition = int(metrics[PARTITION_ID])
                if partition in rows:
                    reason = f"a second evaluation of partition {partition}"
                else:
                    rows[partition] = (int(metrics[CORRECT]), int(metrics[NUM_EXAMPLES]),
                                       float(metrics[LOSS_SUM]))
                    records[partition] = metrics
                    continue
            dropped += 1
            log(WARNING, "round %d: dropped the evaluation reply of %s", server_round,
                "a client (the reason is withheld under differential privacy)"
                if self.privacy is not None else
                f"node {message.metadata.src_node_id}: {one_line(reason)}")
        if self.report is not None and self.report.server_round == server_round:
            self.report.evaluate_dropped = dropped
        held = {pid: rows.pop(pid) for pid in list(rows) if pid >= self.num_training}
        if not rows:
            return None
        summary = evaluation_summary(rows)
        metrics = {
            **summary,
            **summed_timings(records.values()),
            **global_model_accuracy([records[pid] for pid in summary["client-ids"]]),
            **({f"{HELD_OUT}-{key}": value for key, value in evaluation_summary(held).items()}
               if held else {}),
        }
        if self.privacy is not None:
            # A client's own accuracy moves when it was drawn (a personal model that
            # only trains then, as Ditto's): under privacy only the means are reported.
            metrics = {k: v for k, v in metrics.items()
                       if k not in ("client-accuracy", "client-global-accuracy")}
        return MetricRecord(metrics)
