"""An array that is read only when asked for.

A checkpoint can hold thousands of large arrays (the u_k a FedSPC server tracks:
:mod:`strategies.references`). Writing or restoring them one :class:`Deferred` at a
time keeps one of them in memory, never all: ``np.savez`` and ``np.asarray`` turn
each into an array when they reach it, and it is dropped after.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


class Deferred:
    """``np.asarray(deferred)`` calls ``load()`` (each time; nothing is cached)."""

    __slots__ = ("load",)

    def __init__(self, load: Callable[[], np.ndarray]) -> None:
        self.load = load

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        value = np.asarray(self.load())
        return value if dtype is None else value.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"Deferred({self.load!r})"
