"""Client state kept in files, so that it outlives the client's process.

Used in two cases. In a deployment, the node-config key ``state-dir``
(``flower-supernode --node-config "... state-dir='/var/lib/fedspc'"``) keeps each
client's state under ``<state-dir>/<run-name>/``, so a restarted SuperNode, or a
resumed run, continues where it was. In simulation with ``checkpoint = true`` the
clients keep it under the run folder, ``<run folder>/client-state/`` (or
``<client-state-dir>/<run-name>/``), so a killed simulation can be resumed. There the
server writes ``run.json`` (the run's token) into the folder first, and a client
that does not find it as the server wrote it stops (:meth:`DurableState.check_view`):
on a multi-node Ray cluster a client placed on a node that does not share the folder
would otherwise start over from the initial state without a word; and since the
run-config (the server's) names that folder, a node without ``state-dir`` writes
nothing there, nor removes anything, before that check.

Each partition has a committed file ``partition-<id>.npz`` and, between local
training and the server's decision, a pending one ``partition-<id>.pending.npz``;
committing renames the pending file over the committed one. Files are written
atomically (:func:`fedspc_app.core.files.atomic_open`). A file is a plain ``.npz``:
``meta`` (JSON: format, run name, partition id, round, rounds trained) and one array
per state-dict entry, named ``personal/<key>``, ``local-reference/<key>`` or
``personal-model/<key>``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clients.state import BLOCKS, COMMITTED, LOCAL_REFERENCE, PENDING, ClientState
from fedspc_app.core.errors import FedSPCError
from fedspc_app.core.files import (
    atomic_open,
    atomic_write,
    file_lock,
    open_lock,
    sync_folder,
)

STATE_DIR_KEY = "state-dir"
FORMAT_VERSION = 2
SIMULATION_FOLDER = "client-state"
VIEW_MARKER = "run.json"  # written by the server of a simulation, read by its clients
PRIVATE_FILE = 0o600  # a client's state files: personalized models, u_k
PRIVATE_FOLDER = 0o700  # the folder of a run's client state


class DurableStateError(FedSPCError, RuntimeError):
    """A state file exists but cannot be used."""


def private_folder(folder: Path) -> None:
    """Create ``folder`` if missing, for its owner only (missing parents get the
    usual mode): it holds the clients' personalized models, which never leave them.
    One that exists with access for others is made private if this user owns it
    (another user's folder is used as found: a shared filesystem may map owners)."""
    try:
        folder.mkdir(mode=PRIVATE_FOLDER, parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise DurableStateError(f"cannot keep client state in {folder}: it, or a folder "
                                "above it, is a file") from None
    info = folder.stat()
    if info.st_uid == os.getuid() and info.st_mode & 0o077:
        folder.chmod(PRIVATE_FOLDER)


def simulation_folder(run_dir: Path, run_name: str, client_state_dir: str = "") -> Path:
    """Where a simulation's clients keep their state: ``<client-state-dir>/<run-name>``
    when the run-config names one, else ``<run folder>/client-state``."""
    if client_state_dir:
        return Path(client_state_dir).expanduser().resolve() / run_name
    return Path(run_dir) / SIMULATION_FOLDER


def write_view_marker(folder: Path, run_name: str, run_token: str) -> None:
    """The server's mark on a simulation's client-state folder (see :meth:`check_view`)."""
    private_folder(folder)
    with atomic_open(folder / VIEW_MARKER) as handle:
        handle.write(json.dumps({"run-name": run_name, "run-token": run_token}).encode())


@dataclass(frozen=True)
class DurableState:
    """One client's state files in ``directory`` (one folder per run)."""

    directory: Path
    run_name: str
    partition_id: int
    run_token: str = ""
    # A simulation's folder (no node state-dir): the server's run-config named it, so
    # nothing is written or claimed there unless the server of this run marked it
    # (:meth:`check_view`, on every :meth:`lock`).
    marked: bool = False

    @classmethod
    def for_node(cls, node_config: Mapping, run_dir: Path, run_name: str,
                 partition_id: int, *, deployment: bool, checkpoint: bool,
                 run_token: str = "", client_state_dir: str = "",
                 keeps_state: bool = True) -> DurableState | None:
        """The store this client uses, or ``None`` when its state lives in memory.

        A node's own ``state-dir`` is used whatever the server says. Without one, a
        simulation's folder only for a method with client state (its server marks
        that folder with ``run.json``; a method without keeps nothing on disk), and
        the store is :attr:`marked`: a server cannot make a node without state-dir
        write into, or remove files from, a folder the server did not mark."""
        state_dir = str(node_config.get(STATE_DIR_KEY, "") or "")
        if state_dir:
            return cls(Path(state_dir).expanduser() / run_name, run_name, partition_id,
                       run_token)
        if checkpoint and not deployment and keeps_state:
            return cls(simulation_folder(run_dir, run_name, client_state_dir), run_name,
                       partition_id, run_token, marked=True)
        return None

    def check_view(self) -> None:
        """Stop unless this node sees the folder as the server of the simulation wrote
        it: its ``run.json`` with this run's token.

        Raises
        ------
        DurableStateError
            Naming the folder and the fix (a folder every node shares).
        """
        try:
            marker = json.loads((self.directory / VIEW_MARKER).read_text())
        except (OSError, ValueError):
            marker = None
        if isinstance(marker, dict) and marker.get("run-token") == self.run_token:
            return
        found = ("no readable run.json in it" if not isinstance(marker, dict)
                 else "its run.json is of another run")
        raise DurableStateError(
            f"this node does not see the client-state folder {self.directory} as the "
            f"server wrote it ({found}). A simulation's clients keep their state there "
            "between rounds, so on a multi-node Ray cluster it must be a folder every "
            "node sees at the same path (a shared filesystem): set run-config "
            "client-state-dir to one, or put output-dir on one (docs/deployment.md)")

    def path(self, slot: str = COMMITTED) -> Path:
        suffix = ".pending.npz" if slot == PENDING else ".npz"
        return self.directory / f"partition-{self.partition_id}{suffix}"

    def write(self, state: ClientState, slot: str = COMMITTED) -> None:
        """Replace the slot's file with ``state`` (atomically: a crash leaves the old file)."""
        meta = {
            "format": FORMAT_VERSION,
            "run-name": self.run_name,
            "partition-id": self.partition_id,
            "run-token": self.run_token,
            "round": int(state.round),
            "rounds-trained": int(state.rounds_trained),
            "written-at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        arrays: dict[str, np.ndarray] = {"meta": np.array(json.dumps(meta))}
        for prefix, field in BLOCKS.items():
            block: Mapping[str, np.ndarray] | None = getattr(state, field)
            if block is not None:
                arrays.update({f"{prefix}/{key}": np.asarray(value)
                               for key, value in block.items()})
        private_folder(self.directory)
        with atomic_open(self.path(slot), PRIVATE_FILE) as handle:
            np.savez(handle, **arrays)

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """This partition's lock (a hidden file beside its state), held while its files
        are read and replaced, so that two processes of one partition take turns: a
        straggler still training after its round timed out, and the next round's.
        A :attr:`marked` folder is checked first (nothing is created before)."""
        if self.marked:
            self.check_view()
        private_folder(self.directory)
        return file_lock(self.lock_path(), PRIVATE_FILE)

    def lock_path(self) -> Path:
        return self.directory / f".partition-{self.partition_id}.lock"

    def stage(self, state: ClientState) -> bool:
        """Write ``state`` as pending, unless the pending file holds a newer round of
        this run (a straggler's late training must not replace the next round's
        pending state), or a newer run of this name has claimed the partition since
        (:meth:`claim`: this process is a straggler of the run before it). A pending
        file of another run counts as absent. Returns whether it was written."""
        with self.lock():
            if self.owner() not in ("", self.run_token):
                return False
            meta = self._meta(PENDING)
            if meta is not None and int(meta.get("round", 0)) > state.round:
                return False
            self.write(state, PENDING)
            return True

    def commit(self) -> None:
        """Make the pending state the committed one (an atomic rename)."""
        pending = self.path(PENDING)
        if pending.is_file():
            os.replace(pending, self.path(COMMITTED))
            sync_folder(self.directory)

    def discard(self) -> None:
        self.path(PENDING).unlink(missing_ok=True)

    def claim(self) -> bool:
        """Make this run the partition's owner, removing (and returning True for) files
        that an earlier run with the same run name left in this folder: they carry
        another run token. Called under :meth:`lock` (:meth:`ClientLedger.settle
        <clients.state.ClientLedger.settle>`), so that a straggler of that earlier run
        cannot stage between the removal and this run's use of the files; from then
        on its :meth:`stage` sees the new owner and keeps nothing."""
        stale = False
        for slot in (COMMITTED, PENDING):
            meta = self._meta(slot, any_run=True)
            if meta is not None and meta.get("run-token") != self.run_token:
                self.path(slot).unlink(missing_ok=True)
                stale = True
        if self.owner() != self.run_token:
            fd = open_lock(self.lock_path(), PRIVATE_FILE)
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, self.run_token.encode(), 0)
            finally:
                os.close(fd)
        return stale

    def remove_leftovers(self) -> None:
        """Remove the temporary files of this partition's writes that a killed process
        left (they hold u_k). Called under :meth:`lock`, when no write of the partition
        is under way (:meth:`ClientLedger.settle <clients.state.ClientLedger.settle>`)."""
        for slot in (COMMITTED, PENDING):
            for leftover in self.directory.glob(f".{self.path(slot).name}.*.tmp"):
                leftover.unlink(missing_ok=True)

    def owner(self) -> str:
        """The run token of the run that last claimed this partition ("": none did),
        kept in the partition's lock file."""
        try:
            fd = os.open(self.lock_path(), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return ""
        try:
            return os.pread(fd, 256, 0).decode(errors="replace").strip()
        finally:
            os.close(fd)

    def token_of(self, slot: str = COMMITTED) -> str | None:
        """The run token the slot's file was written with (``None``: no file)."""
        meta = self._meta(slot, any_run=True)
        return None if meta is None else str(meta.get("run-token", ""))

    def _meta(self, slot: str, *, any_run: bool = False) -> dict | None:
        loaded = self._load(slot, arrays=False, any_run=any_run)
        return loaded[0] if loaded else None

    def _load(self, slot: str, *, arrays: bool = True, any_run: bool = False
              ) -> tuple[dict, dict[str, dict[str, np.ndarray]]] | None:
        """``(meta, blocks)`` of the slot's file (blocks only when ``arrays``), or None:
        no file (or it went while being opened: another process committed or
        discarded it), or, unless ``any_run``, a file of another run token (a store
        without one reads only files written without one: a message that names no run
        never reads, commits or discards a run's state)."""
        path = self.path(slot)
        if not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"][()]))
                if not (any_run or not isinstance(meta, dict)
                        or meta.get("run-token", "") == self.run_token):
                    return None
                blocks: dict[str, dict[str, np.ndarray]] = {}
                for name in data.files if arrays else ():
                    if name == "meta":
                        continue
                    prefix, _, key = name.partition("/")
                    if prefix not in BLOCKS or not key:
                        raise ValueError(f"unexpected entry {name!r}")
                    blocks.setdefault(prefix, {})[key] = data[name]
        except FileNotFoundError:
            return None
        except OSError as error:  # permissions, an I/O error: the file may be fine
            raise DurableStateError(
                f"cannot read the saved client state {path}: {error}. Keep the file: "
                "check its permissions and the filesystem, then run the round again"
            ) from error
        except (ValueError, KeyError, AttributeError, zipfile.BadZipFile) as error:
            raise DurableStateError(
                f"the saved client state {path} is damaged: {error}. Move the file away "
                "to restart this client from the initial personalized parameters and u_k = 0"
            ) from error
        return meta, blocks

    def read(self, slot: str = COMMITTED, *, any_run: bool = False) -> ClientState | None:
        """The state saved in ``slot``, or ``None`` when there is no file (or only a
        file of another run token, another run with this run name, unless ``any_run``:
        an export, which names such a file rather than use it).

        Raises
        ------
        DurableStateError
            If the file cannot be read or belongs to another run or partition:
            starting over silently is what this store exists to prevent.
        """
        loaded = self._load(slot, any_run=any_run)
        if loaded is None:
            return None
        meta, blocks = loaded
        path = self.path(slot)
        if meta.get("format") != FORMAT_VERSION:
            raise DurableStateError(f"{path} has format {meta.get('format')!r}, "
                                    f"this version reads {FORMAT_VERSION}")
        if (meta.get("run-name"), meta.get("partition-id")) != (self.run_name,
                                                                self.partition_id):
            raise DurableStateError(
                f"{path} holds run {meta.get('run-name')!r} partition "
                f"{meta.get('partition-id')}, not run {self.run_name!r} partition "
                f"{self.partition_id}")
        return ClientState(
            **{BLOCKS[prefix]: block for prefix, block in blocks.items()},
            rounds_trained=int(meta["rounds-trained"]),
            round=int(meta["round"]),
        )


FINAL_MARKER = "final-state.json"
"""In a finished simulation's client-state folder: the files hold each client's final
personalized parameters only (:func:`keep_final_personal`)."""


def keep_final_personal(folder: Path, *, record_size: bool = True) -> int:
    """Strip a finished simulation's client state down to what its models need: each
    client's personalized parameters (and Ditto's personal model), without u_k, so that
    ``python -m fedspc_app.export`` works after a default run; writes
    :data:`FINAL_MARKER`, by which a resume that would need u_k is refused, with the
    bytes kept unless not ``record_size`` (under differential privacy: only the clients
    ever drawn have a file, so the total counts them). Returns the bytes kept."""
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    kept = 0
    for path in sorted(folder.glob("partition-*.npz")):
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files
                      if not name.startswith(LOCAL_REFERENCE + "/")}
        with atomic_open(path, PRIVATE_FILE) as handle:
            np.savez(handle, **arrays)
        kept += path.stat().st_size
    for leftover in folder.glob(".partition-*.npz.*.tmp"):  # a killed client's: u_k
        leftover.unlink(missing_ok=True)
    atomic_write(folder / FINAL_MARKER, json.dumps({
        "contents": "each client's final personalized parameters; no u_k",
        **({"bytes": kept} if record_size else {})}) + "\n")
    sync_folder(folder)
    return kept
