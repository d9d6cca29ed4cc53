"""What a client keeps between rounds, and how it follows the server's decisions.

After local training the client *stages* its new state as pending. The server's
next message to it says, for every partition, the last round whose reply it
aggregated (``accepted-rounds``), and up to which round those decisions are in
its checkpoint (``durable-through``). :meth:`ClientLedger.settle` then commits
the pending state (its reply went into the aggregate) or discards it (the reply
was dropped, the round failed, or the server restarted from an earlier
checkpoint). So the committed state always matches what the server holds:

    invariant: committed.round == accepted-rounds[partition]

and with full participation ū = (1/K) Σ_k u_k over the committed u_k.

Without a store the state lives in Flower's ``context.state``; with one
(:mod:`clients.durable`) it lives only in the store's files, which outlive the
process (and keep memory flat with many clients).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

from flwr.app import ConfigRecord, RecordDict

from fedspc_app.core.errors import FedSPCError
from fedspc_app.core.records import ArrayDict, from_record, to_record

PERSONAL = "personal"
LOCAL_REFERENCE = "local-reference"
PERSONAL_MODEL = "personal-model"
INFO = "client-info"
BLOCKS = {PERSONAL: "personal", LOCAL_REFERENCE: "local_reference",
          PERSONAL_MODEL: "personal_model"}

COMMITTED = ""
PENDING = "pending/"
SLOTS = (COMMITTED, PENDING)


class ClientStateError(FedSPCError, RuntimeError):
    """The client's saved state does not match what the server holds."""


@dataclass(frozen=True)
class ClientState:
    """A client's persistent state.

    Attributes
    ----------
    personal : dict | None
        The personalized state-dict entries (e.g. FedPer's head); ``None`` before
        the first round, when they come from the common initial model.
    local_reference : dict | None
        ``u_k`` of FedSPC (``c_k`` of SCAFFOLD); ``None`` means zero.
    personal_model : dict | None
        Ditto's personal model ``v_k``.
    rounds_trained : int
        Rounds whose training this state includes.
    round : int
        The server round of the last training it includes (0: the initial state).
    """

    personal: ArrayDict | None = None
    local_reference: ArrayDict | None = None
    personal_model: ArrayDict | None = None
    rounds_trained: int = 0
    round: int = 0

    @classmethod
    def from_records(cls, records: RecordDict, slot: str = COMMITTED) -> ClientState | None:
        """The state kept in ``records`` under ``slot``, or ``None`` if there is none."""
        if slot + INFO not in records:
            return None
        info = records[slot + INFO]
        return cls(**{field: from_record(records[slot + key])
                      for key, field in BLOCKS.items() if slot + key in records},
                   rounds_trained=int(info.get("rounds-trained", 0)),
                   round=int(info.get("round", 0)))

    def to_records(self, records: RecordDict, slot: str = COMMITTED) -> None:
        """Put this state into ``records`` under ``slot``, replacing what was there."""
        clear_slot(records, slot)
        for key, field in BLOCKS.items():
            value = getattr(self, field)
            if value is not None:
                records[slot + key] = to_record(value)
        records[slot + INFO] = ConfigRecord({"rounds-trained": self.rounds_trained,
                                             "round": self.round})


def clear_slot(records: RecordDict, slot: str) -> None:
    for key in (*BLOCKS, INFO):
        if slot + key in records:
            del records[slot + key]


class StateStore(Protocol):
    """Files that keep a client's state outside its process (see :mod:`clients.durable`)."""

    def read(self, slot: str = COMMITTED) -> ClientState | None: ...

    def write(self, state: ClientState, slot: str = COMMITTED) -> None: ...

    def stage(self, state: ClientState) -> bool: ...

    def lock(self) -> AbstractContextManager[None]: ...

    def commit(self) -> None: ...

    def discard(self) -> None: ...

    def claim(self) -> bool: ...

    def remove_leftovers(self) -> None: ...


@dataclass
class Decisions:
    """What a server message says about the replies it aggregated.

    ``accepted_rounds[p]`` is the last round whose reply from partition ``p`` went
    into the aggregate (0: none); ``durable_through`` the last round whose
    decisions are in the server's checkpoint, so they survive a server restart.
    """

    accepted_rounds: Sequence[int]
    durable_through: int

    def accepted_round(self, partition_id: int) -> int:
        return int(self.accepted_rounds[partition_id])


class ClientLedger:
    """A client's committed and pending state, in ``context.state`` or in a store."""

    def __init__(self, records: RecordDict, store: StateStore | None = None) -> None:
        self.records = records
        self.store = store
        self.claimed = False  # settle removed files an earlier run of this name left

    def read(self, slot: str = COMMITTED) -> ClientState | None:
        if self.store is not None:
            return self.store.read(slot)
        return ClientState.from_records(self.records, slot)

    def committed(self) -> ClientState:
        return self.read(COMMITTED) or ClientState()

    def stage(self, state: ClientState) -> bool:
        """Keep ``state`` as pending until the server says whether it accepted it, unless
        the pending state is of a newer round (this is a straggler's training, finished
        after its round timed out and the next round staged its own). Returns whether
        ``state`` was kept."""
        if self.store is not None:
            return self.store.stage(state)  # (compares and writes under its lock)
        pending = ClientState.from_records(self.records, PENDING)
        if pending is not None and pending.round > state.round:
            return False
        state.to_records(self.records, PENDING)
        return True

    def commit(self) -> None:
        if self.store is not None:
            self.store.commit()
            return
        pending = ClientState.from_records(self.records, PENDING)
        if pending is not None:
            pending.to_records(self.records, COMMITTED)
            clear_slot(self.records, PENDING)

    def discard(self) -> None:
        if self.store is not None:
            self.store.discard()
        else:
            clear_slot(self.records, PENDING)

    def settle(self, decisions: Decisions | None, partition_id: int, *,
               claim: bool = False) -> ClientState:
        """Commit or discard the pending state as the server decided; return the state
        this client now stands on (a pending state the server accepted but has not yet
        checkpointed is used, not committed). ``decisions`` None: a server that sends
        none, whose every reply counts as accepted (the pending state is committed).
        With ``claim``, the store's files of an earlier run of this run name are
        removed first (:attr:`claimed` says whether there were any)."""
        # Under the store's lock: a straggler's stage cannot slip in between the read
        # of the pending state and its commit, nor a straggler of an earlier run of
        # this name between the claim and the read.
        with self.store.lock() if self.store is not None else nullcontext():
            if self.store is not None:
                self.store.remove_leftovers()
            self.claimed = claim and self.store is not None and self.store.claim()
            pending = self.read(PENDING)
            if pending is not None:
                if decisions is None:
                    self.commit()
                elif pending.round != decisions.accepted_round(partition_id):
                    self.discard()  # dropped, failed, or a stale attempt of a redone round
                elif pending.round <= decisions.durable_through:
                    self.commit()
                else:
                    return pending
            return self.committed()
