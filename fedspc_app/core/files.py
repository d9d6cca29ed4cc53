"""Atomic file writes: readers see the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Open a temporary file beside ``path`` for binary writing; on success it
    replaces ``path`` (after an fsync), on an exception it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates the file for its owner only; give it the mode open() would.
        os.fchmod(fd, 0o666 & ~_umask())
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


def atomic_write(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Write ``data`` (text is UTF-8 encoded) to ``path`` atomically."""
    with atomic_open(path) as handle:
        handle.write(data.encode("utf-8") if isinstance(data, str) else data)
