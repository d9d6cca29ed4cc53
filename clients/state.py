"""What a client keeps between rounds, stored in Flower's ``context.state``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedspc_app.core.task import ArrayDict, from_record, to_record

PERSONAL = "personal"
LOCAL_REFERENCE = "local-reference"
PERSONAL_MODEL = "personal-model"
INFO = "client-info"


class StateStore(Protocol):
    """Where a client's state outlives its process (see :mod:`clients.durable`)."""

    def read(self) -> ClientState | None: ...

    def write(self, state: ClientState) -> None: ...


@dataclass(frozen=True)
class ClientState:
    """A client's persistent state.

    Attributes
    ----------
    personal : dict | None
        The personalized state-dict entries (e.g. FedPer's head); ``None`` before
        the first round, when they come from the common initial model.
    local_reference : dict | None
        ``u_k`` of FedSPC (``c_k`` of SCAFFOLD) over the shared trainable
        parameters; ``None`` means zero (``u_k^0 = 0``).
    personal_model : dict | None
        Ditto's personal model ``v_k`` (every state-dict entry).
    rounds_trained : int
        Number of training rounds this client completed.
    """

    personal: ArrayDict | None = None
    local_reference: ArrayDict | None = None
    personal_model: ArrayDict | None = None
    rounds_trained: int = 0

    @classmethod
    def load(cls, records: RecordDict, store: StateStore | None = None) -> "ClientState":
        """Read the state from ``context.state`` (empty on a client's first round).

        With a durable ``store`` and an empty ``context.state`` (the first message
        after a SuperNode restart), the state comes from the store's file and is put
        back into ``context.state``.
        """
        if store is not None and INFO not in records:
            restored = store.read()
            if restored is not None:
                restored._put(records)
                return restored

        def arrays(key: str) -> ArrayDict | None:
            return from_record(records[key]) if key in records else None

        info = records[INFO] if INFO in records else ConfigRecord()
        return cls(
            personal=arrays(PERSONAL),
            local_reference=arrays(LOCAL_REFERENCE),
            personal_model=arrays(PERSONAL_MODEL),
            rounds_trained=int(info.get("rounds-trained", 0)),
        )

    def commit(self, records: RecordDict, store: StateStore | None = None) -> None:
        """Write the state into ``context.state``; call only after a round succeeded.

        With a durable ``store`` its file is replaced first, so that a failed write
        leaves both copies at the previous round.
        """
        if store is not None:
            store.write(self)
        self._put(records)

    def _put(self, records: RecordDict) -> None:
        staged: dict[str, ArrayRecord] = {}
        for key, value in (
            (PERSONAL, self.personal),
            (LOCAL_REFERENCE, self.local_reference),
            (PERSONAL_MODEL, self.personal_model),
        ):
            if value is not None:
                staged[key] = to_record(value)
        for key, record in staged.items():
            records[key] = record
        records[INFO] = ConfigRecord({"rounds-trained": self.rounds_trained})
