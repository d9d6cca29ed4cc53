"""Node-local durable client state for deployments.

In Flower's deployment engine a SuperNode keeps ``context.state`` in its memory
only: when the SuperNode process restarts, a client would silently start again
from the common initial personalized parameters and ``u_k = 0``. With the
node-config key ``state-dir`` (``flower-supernode --node-config "... state-dir='/var/lib/fedspc'"``)
the client also keeps its :class:`~clients.state.ClientState` in one file per run
and partition under that folder::

    <state-dir>/run-<run id>/partition-<partition id>.npz

The file is replaced atomically (:func:`fedspc_app.core.files.atomic_open`) each time
a round's state is committed, i.e. only after a successful round, and read when
``context.state`` is empty (the first message after a restart). Both the run id
(assigned by the SuperLink) and the partition id (the node's own config) are the
same before and after a SuperNode restart, so the file is found again.

The file is a plain ``numpy`` ``.npz``: ``meta`` (JSON text: format, run id,
partition id, rounds trained) and one array per state-dict entry, named
``personal/<key>``, ``local-reference/<key>`` or ``personal-model/<key>``.
"""

from __future__ import annotations

import json
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from flwr.app import Context

from clients.state import ClientState
from fedspc_app.core.errors import FedSPCError
from fedspc_app.core.files import atomic_open

STATE_DIR_KEY = "state-dir"
FORMAT_VERSION = 1
_BLOCKS = {
    "personal": "personal",
    "local-reference": "local_reference",
    "personal-model": "personal_model",
}


class DurableStateError(FedSPCError, RuntimeError):
    """A state file exists but cannot be used."""


@dataclass(frozen=True)
class DurableState:
    """One client's state file.

    Attributes
    ----------
    directory : Path
        The node's ``state-dir``.
    run_id : int
        The Flower run the state belongs to.
    partition_id : int
        The node's data partition.
    """

    directory: Path
    run_id: int
    partition_id: int

    @classmethod
    def from_context(cls, context: Context) -> DurableState | None:
        """The store named by the node-config ``state-dir``, or ``None`` without one."""
        directory = str(context.node_config.get(STATE_DIR_KEY, "") or "")
        if not directory:
            return None
        return cls(Path(directory).expanduser(), int(context.run_id),
                   int(context.node_config["partition-id"]))

    @property
    def path(self) -> Path:
        """``<state-dir>/run-<run id>/partition-<partition id>.npz``."""
        return self.directory / f"run-{self.run_id}" / f"partition-{self.partition_id}.npz"

    def write(self, state: ClientState) -> None:
        """Replace the file with ``state`` (atomically: a crash leaves the old file)."""
        meta = {
            "format": FORMAT_VERSION,
            "run-id": self.run_id,
            "partition-id": self.partition_id,
            "rounds-trained": int(state.rounds_trained),
            "written-at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        arrays: dict[str, np.ndarray] = {"meta": np.array(json.dumps(meta))}
        for prefix, field in _BLOCKS.items():
            block: Mapping[str, np.ndarray] | None = getattr(state, field)
            if block is not None:
                arrays.update({f"{prefix}/{key}": np.asarray(value)
                               for key, value in block.items()})
        with atomic_open(self.path) as handle:
            np.savez(handle, **arrays)

    def read(self) -> ClientState | None:
        """The saved state, or ``None`` when there is no file yet.

        Raises
        ------
        DurableStateError
            If the file cannot be read or belongs to another run or partition:
            starting over silently is what this store exists to prevent.
        """
        path = self.path
        if not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"][()]))
                blocks: dict[str, dict[str, np.ndarray]] = {}
                for name in data.files:
                    if name == "meta":
                        continue
                    prefix, _, key = name.partition("/")
                    if prefix not in _BLOCKS or not key:
                        raise ValueError(f"unexpected entry {name!r}")
                    blocks.setdefault(prefix, {})[key] = data[name]
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as error:
            raise DurableStateError(
                f"cannot read the saved client state {path}: {error}. Move the file away "
                "to restart this client from the initial personalized parameters and u_k = 0"
            ) from error
        if meta.get("format") != FORMAT_VERSION:
            raise DurableStateError(f"{path} has format {meta.get('format')!r}, "
                                    f"this version reads {FORMAT_VERSION}")
        if (meta.get("run-id"), meta.get("partition-id")) != (self.run_id, self.partition_id):
            raise DurableStateError(
                f"{path} holds run {meta.get('run-id')} partition {meta.get('partition-id')}, "
                f"not run {self.run_id} partition {self.partition_id}")
        return ClientState(
            **{_BLOCKS[prefix]: block for prefix, block in blocks.items()},
            rounds_trained=int(meta["rounds-trained"]),
        )
