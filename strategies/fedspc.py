"""FedSPC's server side: a :class:`PersonalizedFedAvg` that also keeps u_bar.

:class:`FedSPC` works for any method whose clients upload their final shared
parameters. It adds ``u_bar^t`` to every training message (Algorithm 1, step 1),
aggregates the shared parameters as :class:`PersonalizedFedAvg` does (step 4,
``theta_s^{t+1} = theta_s^t + mean_k Delta theta_k``), and updates
``u_bar^{t+1} = u_bar^t + (1/K) sum_{k in S_t} (u_k^{t+1} - u_k^t)`` with K the
total number of clients, so partial participation works.

The reference change of client k is ``-u_bar^t - Delta theta_k / (E_k eta)``, a
deterministic function of what the server already has. By default
(``upload="derived"``) clients upload only their shared parameters and the number
of shared steps E_k, and the server derives the change with the same function the
client uses (:mod:`fedspc_app.core.correction`, which also holds the u_bar update),
so FedSPC costs no extra upload bytes; ``upload="explicit"`` makes clients also send
the change, as the paper describes. Both give identical parameters.

Under a robust aggregation rule (:mod:`strategies.aggregation`) the u_bar update
follows the same rule: the sum of the changes is replaced by the number of accepted
replies times the coordinate-wise median or trimmed mean of the changes, or the mean
of the changes of the clients Krum selects. Under ``aggregation="weighted"`` it is
that count times the changes' mean weighted as theta_s is (by training images): with
every client training, u_bar stays the weighted mean of the u_k and the correction
cancels in theta_s's weighted aggregate (with the plain sum, u_bar is the unweighted
mean, and at the fixed point u_k = g_k theta_s would follow the unweighted mean
gradient). Under the mean it is Algorithm 1's sum, bit for bit. A server optimizer
moves theta_s only.

u_bar is then the running sum of the rounds' robust centres, and a bias that has
the same sign every round (one persistent attacker shifts the median of the changes
a little, always the same way) accumulates in it. ``reference="client-centre"`` does
not accumulate: the server keeps every training client's u_k (it can: u_k^0 = 0 and
the server has every accepted change; K copies of the corrected block, on disk:
:mod:`strategies.references`, and in the checkpoint) and sets u_bar to the rule's
centre of all K of them, clients that have not trained yet counting with u_k = 0.
Under the mean it is Algorithm 1 (u_bar stays the mean of the u_k), up to float
rounding; under a robust rule u_bar stays inside the honest clients' range whatever
the rounds. ``reference="server-centre"`` is the client centre with the server as
the keeper of the u_k: each training message carries the client's u_k as the server
has it, and the client trains with that one. An honest client's is its own bit for
bit; a client whose reply was off (a lie, a bounded update) trains from the u_k that
reply gave it, so a lie repeated every round is not integrated into its u_k round
after round (its next honest update undoes it), and the server's and the client's u_k
never drift apart. It costs one more copy of the corrected block in each training
message. The default, ``reference="auto"``, is Algorithm 1's increment under the
mean (and under differential privacy) and the server centre under a robust rule.
Under Krum the client centre scores what u_bar is made of, the u_k (which carry
the reported E_k); the increment averages the changes of the clients Krum selected
on their shared updates, which do not show E_k (kept so, for the results measured
with it; the server also checks each E_k against its partition's size).

Under differential privacy (``privacy``) u_bar is computed from the privatized
aggregate only: every client takes the same public number of steps E, and the
server releases ``Delta~ = (sum_k Delta theta_k + noise) / (qK)``, so the sum of the
changes ``-m u_bar - sum_k Delta theta_k / (E eta)`` is estimated as
``-qK u_bar - qK Delta~/(E eta)``, with the expected count qK (public) for m:
post-processing of what is released (the clients' u_k follow Algorithm 1). With
``reference_smoothing`` = beta > 0 (``dp-reference-smoothing``) u_bar is then
``beta u_bar^t + (1 - beta) u_bar^{t+1}``, an exponential average over rounds that
damps the release's noise in u_bar (docs/privacy.md derives by how much, and the lag
it adds).

With ``robust-norm-bound = "median"`` a robust rule first scales each update to at
most the round's median update norm (:meth:`AggregationRule.bound_factors`), and the
server derives that client's reference change from the bounded update, so theta_s and the
tracked u_k follow the same reply (:meth:`FedSPC.reference_change_of`).

SCAFFOLD is this strategy with every parameter shared.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from logging import INFO
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from fedspc_app.core.config import CENTRE_RULES, REFERENCE_RULES, resolve_reference
from fedspc_app.core.correction import (
    global_reference_update,
    reference_change,
    shared_update,
    zeros_like,
)
from fedspc_app.core.dp_mechanism import smooth
from fedspc_app.core.protocol import (
    ARRAYS,
    CLIENT_REFERENCE_RECORD,
    GLOBAL_REFERENCE,
    METRICS,
    NUM_EXAMPLES,
    PARTITION_ID,
    REFERENCE_CHANGE,
    REFERENCE_UPLOAD,
    SHARED_STEPS,
)
from fedspc_app.core.records import ArrayDict, to_record
from fedspc_app.core.replies import ReplySchema, reply_arrays, train_schema
from strategies.aggregation import robust_reference_sum
from strategies.personalized import PersonalizedFedAvg
from strategies.references import ClientReferences

# How far (relative, L2) an uploaded reference change may be from the one the server
# derives from the same reply (fedspc-upload = "explicit"): float32 rounding only.
UPLOAD_TOLERANCE = 1e-5
# The checkpoint's key prefix of a tracked u_k (CENTRE_RULES): client/<pid>/<key>.
CLIENT_REFERENCE = "client/"


class FedSPC(PersonalizedFedAvg):
    """Shared-parameter correction on top of :class:`PersonalizedFedAvg`.

    Parameters
    ----------
    corrected_keys : Sequence[str]
        The shared trainable parameters (keys of u_k and u_bar); shared buffers
        such as BatchNorm statistics are averaged but not corrected.
    learning_rate : float
        The clients' local learning rate eta.
    upload : {"derived", "explicit"} (default: "derived")
        Whether clients upload their reference change or the server derives it.
    reference : {"auto", "increment", "client-centre", "server-centre"} (default: "auto")
        How u_bar follows the clients: Algorithm 1's increment by the (rule's centre
        of the) reference changes, or the rule's centre of every client's u_k, which
        the server then tracks; ``server-centre``: that centre, and each client
        trains with the u_k the server keeps for it (sent in its training message)
        instead of its own; ``auto``: the increment under the mean or with
        differential privacy, the server centre under a robust rule.
    reference_dir : str | Path | None (default: None, a temporary folder)
        The centre rules: the folder the tracked u_k are kept in
        (:class:`~strategies.references.ClientReferences`); the ServerApp passes the
        run folder.
    **kwargs
        The arguments of :class:`PersonalizedFedAvg` (``shared_keys`` and so on).
    """

    def __init__(
        self,
        *,
        corrected_keys: Sequence[str],
        learning_rate: float,
        upload: str = "derived",
        reference: str = "auto",
        reference_dir: str | Path | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if upload not in ("derived", "explicit"):
            raise ValueError(f"upload must be 'derived' or 'explicit', got {upload!r}")
        if reference not in REFERENCE_RULES:
            raise ValueError(f"reference must be one of {REFERENCE_RULES}, got {reference!r}")
        reference = resolve_reference(reference, self.rule.name, self.privacy is not None)
        if reference in CENTRE_RULES and self.privacy is not None:
            raise ValueError("reference 'client-centre' needs every client's reference "
                             "change, which differential privacy does not release")
        if reference in CENTRE_RULES and self.rule.name == "weighted":
            raise ValueError(f"reference {reference!r} counts every client's u_k alike; "
                             "under the weighted mean u_bar needs 'increment'")
        missing = set(corrected_keys) - set(self.shared_keys)
        if missing:
            raise ValueError(f"corrected keys outside the shared block: {sorted(missing)[:3]}")
        self.corrected_keys = tuple(corrected_keys)
        self.learning_rate = float(learning_rate)
        self.upload = upload
        self.reference = reference
        self.global_reference: ArrayDict | None = None
        # "client-centre": u_k by partition id, on disk (created in round 1)
        self.reference_dir = reference_dir
        self.client_references: Mapping[int, ArrayDict] = {}
        self.num_clients = 0
        self.round_learning_rate = self.learning_rate

    def summary(self) -> None:
        log(INFO, "\t├──> FedSPC: %d corrected keys, eta=%g, reference change %s, "
            "u_bar by %s", len(self.corrected_keys), self.learning_rate, self.upload,
            self.reference)
        super().summary()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {**super().state_dict(), "num-clients": self.num_clients}

    def state_arrays(self) -> ArrayDict:
        """u_bar and the tracked u_k (``client/<pid>/<key>``), for a checkpoint
        (empty before round 1)."""
        arrays = dict(self.global_reference or {})
        if isinstance(self.client_references, ClientReferences):
            # Read one at a time as the checkpoint writes them, never all K at once.
            arrays.update(self.client_references.deferred(CLIENT_REFERENCE))
        return arrays

    def load_state_dict(self, state: dict, completed_round: int,
                        global_reference: ArrayDict | None = None) -> None:
        super().load_state_dict(state, completed_round)
        self.num_clients = int(state.get("num-clients", 0))
        if not global_reference:
            return
        global_reference = dict(global_reference)  # the caller's stays as it was
        tracked: dict[int, dict[str, object]] = {}  # the arrays are read one by one below
        for name in [n for n in global_reference if n.startswith(CLIENT_REFERENCE)]:
            pid, key = name[len(CLIENT_REFERENCE):].split("/", 1)
            tracked.setdefault(int(pid), {})[key] = global_reference.pop(name)
        if set(global_reference) != set(self.corrected_keys):
            raise ValueError("the checkpoint's u_bar does not cover the corrected keys")
        if any(set(reference) != set(self.corrected_keys) for reference in tracked.values()):
            raise ValueError("a tracked u_k of the checkpoint does not cover the corrected keys")
        # A centre rule tracks the u_k of every accepted reply: none tracked after an
        # accepted one means the increment wrote it; rounds that all failed track none.
        if self.reference in CENTRE_RULES and any(self.accepted_rounds) and not tracked:
            raise ValueError("the checkpoint keeps no u_k, though it has accepted "
                             "replies: it was written with reference 'increment'")
        self.global_reference = {key: np.asarray(value, dtype=np.float32)
                                 for key, value in global_reference.items()}
        if isinstance(self.client_references, ClientReferences):
            self.client_references.close()
        self.client_references = {}
        if tracked:
            store = self.reference_store()
            for pid, reference in tracked.items():
                for key, value in reference.items():
                    store.put(pid, key, np.asarray(value))

    # ------------------------------------------------------------------ training
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Broadcast theta_s^t and u_bar^t (Algorithm 1, step 1)."""
        config[REFERENCE_UPLOAD] = self.upload
        messages = list(super().configure_train(server_round, arrays, config, grid))
        # The round's eta: Algorithm 1's reference change divides by E eta of the round.
        self.round_learning_rate = (self.learning_rate_of(server_round)
                                    if self.learning_rates is not None else self.learning_rate)
        if self.global_reference is None:  # u_bar^0 = 0
            self.global_reference = zeros_like(self.broadcast, self.corrected_keys)
        # K: every client of the run that trains, sampled, connected or not (u_bar is
        # their mean u_k); held-out clients have no u_k.
        self.num_clients = self.num_training
        reference = to_record(self.global_reference)
        for message in messages:
            message.content[GLOBAL_REFERENCE] = reference
            if self.reference == "server-centre":
                self.attach_client_reference(message)
        return messages

    def attach_client_reference(self, message: Message) -> None:
        """``reference="server-centre"``: send the destination client the u_k the
        server keeps for it (0 before its first accepted reply), which the client
        trains with in place of its own. The server is then the keeper of every u_k:
        an accepted reply moves the client's u_k by the change the server derived
        from what it aggregated (a bounded update's, under ``robust-norm-bound``), so
        the two never drift apart, and a reply that is off by the same vector every
        round is not integrated into the client's u_k round after round: the client
        trains from the u_k its lie produced, and its next honest update undoes it."""
        pid = self.sampler.partition_of.get(message.metadata.dst_node_id)
        if pid is None:  # not bound (sampling binds every node it sends training)
            return
        store = self.reference_store()
        tracked = store[pid] if pid in store else zeros_like(self.global_reference,
                                                             self.corrected_keys)
        # A round's messages share one RecordDict: this one gets its own (the records
        # in it stay shared, not copied).
        content = RecordDict(dict(message.content.items()))
        content[CLIENT_REFERENCE_RECORD] = to_record(tracked)
        message.content = content

    def reply_schema(self) -> ReplySchema:
        """:class:`PersonalizedFedAvg`'s schema, with FedSPC's own fields: the shared
        steps E_k (at least 1), and an uploaded reference change with u_bar's keys,
        dtype and shapes."""
        explicit = self.upload == "explicit" and self.global_reference is not None
        return train_schema(self.broadcast, self.num_partitions, steps_required=True,
                            reference_change=self.global_reference if explicit else None,
                            clipping_bit=self.reports_clipping_bit)

    def check_reply(self, message: Message) -> str | None:
        """:class:`PersonalizedFedAvg`'s checks; with ``upload="explicit"`` also that the
        uploaded reference change is the one its shared update implies (the client's
        arithmetic is the server's: an honest upload matches bit for bit), so that no
        client can move its u_k apart from what it sent for theta_s."""
        reason = super().check_reply(message)
        if reason is not None or self.upload != "explicit" or self.global_reference is None:
            return reason
        uploaded = reply_arrays(message, REFERENCE_CHANGE)
        derived = self.derived_change(message)
        gap = sum(float(np.sum(np.square(np.subtract(uploaded[k], derived[k],
                                                     dtype=np.float64)))) for k in derived)
        size = sum(float(np.sum(np.square(derived[k], dtype=np.float64))) for k in derived)
        if not gap <= UPLOAD_TOLERANCE ** 2 * size:
            return ("the uploaded reference change is not the one its shared update and "
                    "'shared-steps' imply (relative difference "
                    f"{np.sqrt(gap / size) if size > 0 else float('inf'):.3g})")
        return None

    def reference_change_of(self, message: Message, factor: float = 1.0) -> ArrayDict:
        """``u_k^{t+1} - u_k^t`` of one accepted reply (uploaded or derived); with the
        ``factor`` its update's norm was bounded by (``robust-norm-bound``), the
        change of the bounded update, ``-u_bar - factor Delta theta_k / (E_k eta)``:
        the u_k the server tracks follow the update the rule saw."""
        if self.upload == "explicit":
            change = reply_arrays(message, REFERENCE_CHANGE)
            if factor == 1.0:
                return change
            return {key: (-u_bar + factor * (np.asarray(change[key], np.float64) + u_bar))
                    .astype(np.float32) for key, u_bar in self.global_reference.items()}
        return self.derived_change(message, factor)

    def derived_change(self, message: Message, factor: float = 1.0) -> ArrayDict:
        """The change a (checked) reply's own shared update implies, the update scaled
        by ``factor`` first: ``-u_bar - factor Delta theta_k / (E_k eta)``."""
        final = reply_arrays(message, ARRAYS)
        update = shared_update(final, self.broadcast, self.corrected_keys)
        if factor != 1.0:
            update = {key: (value * np.float64(factor)).astype(np.float32)
                      for key, value in update.items()}
        steps = int(message.content.metric_records[METRICS][SHARED_STEPS])
        return reference_change(update, self.global_reference, steps=steps,
                                learning_rate=self.round_learning_rate)

    def aggregate_accepted(
        self, server_round: int, accepted: Sequence[Message]
    ) -> tuple[ArrayRecord, MetricRecord]:
        """Aggregate theta_s as :class:`PersonalizedFedAvg` does, then update u_bar
        (step 4); a failed round changes neither."""
        arrays, metrics = super().aggregate_accepted(server_round, accepted)
        factors = self.norm_factors or [1.0] * len(accepted)
        changes: Iterable[ArrayDict] = (self.reference_change_of(m, factor)
                                        for m, factor in zip(accepted, factors))
        if self.reference in CENTRE_RULES:
            self.global_reference = self.client_centre(accepted, changes)
        else:
            previous = self.global_reference
            self.global_reference = global_reference_update(
                previous, self.summed_changes(accepted, changes),
                num_clients=max(self.num_clients, len(accepted)))
            if self.privacy is not None and self.privacy.reference_smoothing > 0:
                # dp-reference-smoothing: an exponential average of the released u_bar
                # over rounds, post-processing that damps the noise it carries
                # (docs/privacy.md); off, Algorithm 1's u_bar as it is.
                self.global_reference = smooth(previous, self.global_reference,
                                               self.privacy.reference_smoothing)
        norm = float(np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2))
                                 for v in self.global_reference.values())))
        metrics["global-reference-norm"] = norm
        return arrays, metrics

    def summed_changes(self, accepted: Sequence[Message],
                       changes: Iterable[ArrayDict]) -> Iterable[ArrayDict]:
        """What Algorithm 1's increment of u_bar sums: the accepted replies' changes,
        or under DP, a robust rule or the weighted mean the one term that stands for
        their sum."""
        if self.privacy is not None:
            # Differential privacy: from the privatized aggregate alone. Every client
            # took the same public E steps, so sum_k (u_k' - u_k) = -m u_bar -
            # sum_k Delta theta_k / (E eta); the release is the noised sum over qK,
            # and qK (public) stands for m (private: who was drawn and replied).
            delta = shared_update(self.privatized, self.broadcast, self.corrected_keys)
            change = reference_change(delta, self.global_reference, steps=self.privacy.steps,
                                      learning_rate=self.round_learning_rate)
            return [{k: v.astype(np.float64) * self.expected_clients
                     for k, v in change.items()}]
        if self.rule.robust or self.rule.name == "weighted":
            # The sum over the accepted replies' changes, replaced by their count
            # times the rule's centre of the changes (Krum: of the selected ones;
            # weighted: their mean with theta_s's weights, so the correction cancels).
            weights = [float(m.content.metric_records[METRICS][NUM_EXAMPLES])
                       for m in accepted]
            return [robust_reference_sum(self.rule, list(changes), self.selected,
                                         len(accepted), weights)]
        return changes

    def client_centre(self, accepted: Sequence[Message],
                      changes: Iterable[ArrayDict]) -> ArrayDict:
        """``reference="client-centre"``: add each accepted reply's change to the
        tracked u_k of its client, then u_bar = the rule's centre of all K u_k (Krum:
        the mean of those it selects, scored on the u_k; a client that has not trained
        counts with u_k = 0). Under the mean this is Algorithm 1's mean of the u_k."""
        store = self.reference_store()
        for message, change in zip(accepted, changes):
            store.add(int(message.content.metric_records[METRICS][PARTITION_ID]), change)
        return store.centre(self.rule, max(self.num_clients, max(store) + 1))

    def reference_store(self) -> ClientReferences:
        """The tracked u_k (``client-centre``), created empty on first use."""
        if not isinstance(self.client_references, ClientReferences):
            shapes = {key: np.shape(self.global_reference[key]) for key in self.corrected_keys}
            self.client_references = ClientReferences(shapes, self.num_partitions,
                                                      folder=self.reference_dir)
        return self.client_references
