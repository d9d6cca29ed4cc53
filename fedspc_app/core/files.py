"""Atomic file writes (readers see the old file or the new one, never half of one),
folder locks (one process at a time writes a run's or a grid's folder) and file locks
(processes take turns at a short read-compare-write)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import tempfile
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from fedspc_app.core.errors import BusyError, ConfigError, LockError


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: int | None = None
                ) -> Iterator[BinaryIO]:
    """Open a temporary file beside ``path`` for binary writing; on success it
    replaces ``path`` (after an fsync), on an exception it is removed. The file gets
    ``mode`` (e.g. 0o600 for a private one), by default the mode open() would give."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates the file for its owner only; give it the mode asked for.
        os.fchmod(fd, 0o666 & ~_umask() if mode is None else mode)
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        sync_folder(path.parent)  # the rename itself survives a power loss
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def sync_folder(folder: str | os.PathLike[str]) -> None:
    """fsync a folder, so that a rename or a new file in it is on disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; put it back at once
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike[str], data: bytes | str,
                 mode: int | None = None) -> None:
    """Write ``data`` (text is UTF-8 encoded) to ``path`` atomically (``mode``: as
    :func:`atomic_open`'s)."""
    with atomic_open(path, mode) as handle:
        handle.write(data.encode("utf-8") if isinstance(data, str) else data)


# flock's errors where the filesystem has no locks (NFS without lockd, Lustre mounted
# without -o flock, some FUSE or SMB mounts): every try would fail the same way.
NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP)


def _flock(fd: int, flags: int, path: Path) -> None:
    """``fcntl.flock``; a filesystem without locks is one :class:`LockError` naming
    the lock file and what to do (not a bare OSError on every round)."""
    try:
        fcntl.flock(fd, flags)
    except OSError as error:
        if error.errno not in NO_LOCKS:
            raise
        raise LockError(
            f"cannot lock {path}: its filesystem does not support flock "
            f"({os.strerror(error.errno)}). Put this folder on a local filesystem (for a "
            "SuperNode, a local state-dir), or mount the shared one with flock support "
            "(NFS with its lock service, Lustre with -o flock)") from None


def open_lock(path: Path, mode: int) -> int:
    """Open (create with ``mode``) the lock file ``path`` for reading and writing,
    never through a symlink (one planted in a shared folder would make this process
    create or lock a file elsewhere), and only a regular file.

    Raises
    ------
    LockError
        If ``path`` is a symlink, a folder or another non-regular file.
    """
    refused = LockError(f"the lock file {path} is not a regular file (a symlink, a "
                        "folder or a device): remove it (and check who could put it "
                        "there); the lock is then created afresh")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise refused from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise refused
    return fd


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str], mode: int = 0o666) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` (created with ``mode`` if missing)
    while the block runs, waiting while another process holds it: for a short
    read-compare-write that two processes must not interleave. The kernel's
    ``flock``, released however the holder ends; the file stays."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = open_lock(path, mode)
    try:
        _flock(fd, fcntl.LOCK_EX, path)
        yield
    finally:
        os.close(fd)  # releases the lock


def lock_path(folder: str | os.PathLike[str]) -> Path:
    """The lock file of ``folder``: beside it, hidden, so that the folder holds only
    results (it stays after the lock is released)."""
    folder = Path(folder)
    return folder.parent / f".fedspc-{folder.name}.lock"


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike[str], what: str, *, attempts: int = 3,
                pause: float = 0.2) -> Iterator[None]:
    """Hold ``folder``'s lock while the block runs (``what`` says who holds it, for
    the error another process gets). The folder itself is not created.

    The lock is the kernel's (``flock``) on a file in the folder, so it is released
    however the holder ends, a crash or SIGKILL included: a stopped run never
    leaves its folder locked. Works between processes on one machine (and on
    filesystems that support ``flock``).

    The file says who holds the lock, and since when, while it is held; it is left
    empty when released (its text kept the run's start; its file times remain, as
    every file's do: docs/privacy.md).

    Raises
    ------
    BusyError
        If another process holds the lock (tried ``attempts`` times, ``pause``
        seconds apart, so that a brief probe by :func:`lock_holder` is not mistaken
        for a holder).
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    fd = open_lock(lock_path(folder), 0o666)
    held = False
    try:
        for attempt in range(attempts):
            try:
                _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, lock_path(folder))
                break
            except BlockingIOError:
                if attempt == attempts - 1:
                    raise BusyError(
                        f"{folder} is in use by {holder_text(_read_holder(fd))}; wait "
                        "for it to end or stop it (two processes writing one folder "
                        "would mix their results)") from None
                time.sleep(pause)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({
            "what": what, "pid": os.getpid(), "host": socket.gethostname(),
            "since": datetime.now(UTC).isoformat(timespec="seconds")}).encode(), 0)
        held = True
        yield
    finally:
        if held:  # the holder's record is for while it holds (no start time kept in it)
            os.ftruncate(fd, 0)
        os.close(fd)  # releases the lock


def lock_holder(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Who holds ``folder``'s lock now (``what``, ``pid``, ``host``, ``since``), or
    None when nobody does. Probes with a shared lock, released at once."""
    try:
        fd = os.open(lock_path(folder), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            _flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, lock_path(folder))
        except BlockingIOError:
            return _read_holder(fd)
        return None
    finally:
        os.close(fd)


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        holder = {}
    return holder if isinstance(holder, dict) else {}


def holder_text(holder: dict[str, Any]) -> str:
    """A lock holder (from :func:`lock_holder`) in words."""
    if not holder.get("pid"):
        return "another process"
    return (f"{holder.get('what') or 'another process'} (pid {holder['pid']} on "
            f"{holder.get('host', '?')}, since {holder.get('since', '?')})")


def find_folder(data_dir: Path, folder: str, required: Sequence[str]) -> Path | None:
    """Locate ``folder`` under ``data_dir``, or accept ``data_dir`` as that folder."""
    nested = data_dir / folder
    if nested.is_dir():
        return nested
    if data_dir.is_dir() and (
        data_dir.name == folder or all((data_dir / f).exists() for f in required)
    ):
        return data_dir
    return None


def expand_user(path: str, key: str) -> Path:
    """``path`` with a leading ``~`` or ``~user`` expanded; a ``~`` that names no
    user's home folder is a ConfigError naming the run-config ``key``."""
    try:
        return Path(path).expanduser()
    except RuntimeError:  # ~name of no user, or no home folder at all
        raise ConfigError(f"run-config '{key}' = {path!r}: cannot expand '~' "
                          "(no such user's home folder)") from None
