"""The u_k a FedSPC server tracks (``fedspc-reference = "client-centre"``), on disk.

K clients' references of a corrected block of d floats are K × d float32: 8.5 GB for
a full-width ResNet-34 body at K = 100. :class:`ClientReferences` keeps them in one
``.npy`` file of shape (K, d), one client a row (``np.load(path, mmap_mode="r")``
maps it), in a folder of its own that is removed with it, and reads and writes it
with positioned I/O:

* adding a client's reference change reads and writes that client's row (d floats,
  as large as the reply it came from);
* the aggregation rule's centre of the K rows is taken one block of coordinates at a
  time: K × ``block`` floats in memory (``block_bytes``, 32 MiB by default), never
  K × d. Each coordinate's median or trimmed mean is the one of its K values, so the
  result is the in-memory rule's, bit for bit;
* Krum's K × K squared distances are accumulated block by block (float64 Gram
  matrices), then scored as Flower's ``select_multikrum`` scores them.

The server's memory is then O(d + K × block + K²), flat in K × d. Positioned reads
rather than a mapped array: every page of a mapping that a pass over the K rows
touches is counted in the server's resident memory until the kernel evicts it, and a
pass reads all K × d.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from fedspc_app.core.deferred import Deferred
from fedspc_app.core.records import ArrayDict
from strategies.aggregation import AggregationRule, krum_choice

PREFIX = ".client-references-"  # the store's own folder, inside ``folder``
FILE = "u_k.npy"


def _private(path: str, flags: int) -> int:
    """open()'s opener for a file its owner alone may read (the u_k of every client)."""
    return os.open(path, flags, 0o600)


def _remove(fd: int, folder: str) -> None:
    os.close(fd)
    shutil.rmtree(folder, ignore_errors=True)


class ClientReferences(Mapping[int, ArrayDict]):
    """The u_k of clients ``0 … rows − 1`` (float32, every one 0 until changed);
    as a Mapping, those of the clients that changed theirs, by partition id.

    Parameters
    ----------
    shapes : Mapping[str, tuple[int, ...]]
        The corrected keys and their shapes, in the order of a row.
    rows : int
        K, the clients (partition ids ``0 … rows − 1``).
    folder : str | Path | None (default: None, the system's temporary folder)
        Where the file goes: a new subfolder ``.client-references-*``; those a
        server that was stopped left there are removed (the run folder's lock keeps
        one server per folder). It needs rows × d × 4 bytes.
    block_bytes : int (default: 32 MiB)
        The memory one block of coordinates of all K clients may take.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], rows: int, *,
                 folder: str | Path | None = None, block_bytes: int = 32 << 20) -> None:
        self.shapes = {key: tuple(int(n) for n in shape) for key, shape in shapes.items()}
        self.rows = int(rows)
        sizes = [math.prod(shape) for shape in self.shapes.values()]
        self.offsets = dict(zip(self.shapes, np.cumsum([0, *sizes[:-1]]).tolist()))
        self.width = int(sum(sizes))
        self.block = max(1, int(block_bytes) // (4 * max(self.rows, 1)))
        if folder is not None:  # what a server that was stopped left there
            Path(folder).mkdir(parents=True, exist_ok=True)
            for stale in Path(folder).glob(PREFIX + "*"):
                shutil.rmtree(stale, ignore_errors=True)
        self.folder = Path(tempfile.mkdtemp(prefix=PREFIX, dir=folder))
        self.path = self.folder / FILE
        with open(self.path, "wb", opener=_private) as handle:  # (u_k: 0600, as a client's)
            np.lib.format.write_array_header_1_0(handle, {
                "descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)),
                "fortran_order": False, "shape": (self.rows, self.width)})
            self.header = handle.tell()
            handle.truncate(self.header + 4 * self.rows * self.width)  # sparse zeros
        self.fd = os.open(self.path, os.O_RDWR)
        self.tracked: set[int] = set()
        self._finalizer = weakref.finalize(self, _remove, self.fd, str(self.folder))

    # ------------------------------------------------------------------ raw I/O
    def _offset(self, pid: int, start: int) -> int:
        if not 0 <= pid < self.rows:
            raise KeyError(f"partition {pid} is outside the {self.rows} tracked clients")
        return self.header + 4 * (pid * self.width + start)

    def _read(self, pid: int, start: int, out: np.ndarray) -> np.ndarray:
        """Fill ``out`` (float32, contiguous) with row ``pid`` from coordinate ``start``."""
        view, offset = memoryview(out).cast("B"), self._offset(pid, start)
        while view:
            count = os.preadv(self.fd, [view], offset)
            if count <= 0:
                raise OSError(f"{self.path} ends before client {pid}'s reference")
            view, offset = view[count:], offset + count
        return out

    def _write(self, pid: int, start: int, values: np.ndarray) -> None:
        view = memoryview(np.ascontiguousarray(values, dtype=np.float32)).cast("B")
        offset = self._offset(pid, start)
        while view:
            count = os.pwrite(self.fd, view, offset)
            view, offset = view[count:], offset + count

    def _row(self, pid: int) -> np.ndarray:
        return self._read(pid, 0, np.empty(self.width, dtype=np.float32))

    def _split(self, row: np.ndarray) -> ArrayDict:
        return {key: row[self.offsets[key]:self.offsets[key] + math.prod(shape)]
                .reshape(shape) for key, shape in self.shapes.items()}

    # ------------------------------------------------------------------ Mapping
    def __getitem__(self, pid: int) -> ArrayDict:
        if pid not in self.tracked:
            raise KeyError(pid)
        return self._split(self._row(pid))

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.tracked))

    def __len__(self) -> int:
        return len(self.tracked)

    # ------------------------------------------------------------------ updates
    def add(self, pid: int, change: Mapping[str, np.ndarray]) -> None:
        """``u_k += change`` for client ``pid`` (float32, as
        :func:`fedspc_app.core.correction.add`)."""
        parts = self._split(self._row(pid))
        row = np.concatenate([np.add(parts[key], change[key], dtype=np.float32).ravel()
                              for key in self.shapes])
        self._write(pid, 0, row)
        self.tracked.add(pid)

    def put(self, pid: int, key: str, value: np.ndarray) -> None:
        """Set one key of client ``pid``'s u_k (restoring a checkpoint)."""
        value = np.asarray(value, dtype=np.float32)
        if value.shape != self.shapes[key]:
            raise ValueError(f"client {pid}'s {key!r} has shape {value.shape}, "
                             f"expected {self.shapes[key]}")
        self._write(pid, self.offsets[key], value.ravel())
        self.tracked.add(pid)

    def deferred(self, prefix: str) -> dict[str, Deferred]:
        """``<prefix><pid>/<key>`` → each tracked key of each u_k, read when a
        checkpoint writes it (one at a time)."""
        def reader(pid: int, key: str):
            shape = self.shapes[key]
            return lambda: self._read(pid, self.offsets[key], np.empty(
                math.prod(shape), dtype=np.float32)).reshape(shape)

        return {f"{prefix}{pid}/{key}": Deferred(reader(pid, key))
                for pid in self for key in self.shapes}

    # ------------------------------------------------------------------ centres
    def blocks(self, rows: Sequence[int]) -> Iterator[tuple[int, np.ndarray]]:
        """(first coordinate, len(rows) × block float32) over the row, block by block."""
        for start in range(0, self.width, self.block):
            out = np.empty((len(rows), min(self.block, self.width - start)), np.float32)
            for i, pid in enumerate(rows):
                self._read(pid, start, out[i])
            yield start, out

    def distances(self, count: int) -> np.ndarray:
        """Squared L2 distances between the u_k of clients ``0 … count − 1`` (float64)."""
        total = np.zeros((count, count), dtype=np.float64)
        for _, block in self.blocks(range(count)):
            values = block.astype(np.float64)
            gram = values @ values.T
            norms = np.diag(gram)
            total += norms[:, None] + norms[None, :] - 2.0 * gram
        return total

    def centre(self, rule: AggregationRule, count: int) -> ArrayDict:
        """The rule's centre of the u_k of clients ``0 … count − 1`` (a client not
        tracked counts with u_k = 0): the coordinate-wise median or trimmed mean, the
        mean, or for Krum the mean of those it selects, scored on the u_k."""
        rows: Sequence[int] = range(count)
        if rule.name in ("krum", "multi-krum") and count > 1:
            rows = krum_choice(self.distances(count), rule.byzantine, rule.krum_count(count))
        out = np.empty(self.width, dtype=np.float32)
        for start, block in self.blocks(rows):
            out[start:start + block.shape[1]] = rule.centre_rows(block)
        return self._split(out)

    def close(self) -> None:
        """Remove the file (also done when the store is garbage collected)."""
        self._finalizer()
