"""Pausing a run, or a grid of runs, at a round boundary.

A pause request is a small file, :data:`PAUSE_REQUEST`, in a run's results folder
(or a grid's folder). The ServerApp looks for it after each round's checkpoint: it
then ends the run there, its summary saying ``"paused-after-round": N``, and the
run continues from that checkpoint when started again with ``resume = true``. A
grid's runner looks for its own request between cells. Requests are written by
``python -m fedspc_app.experiments pause`` and removed by whoever honours them.

A request older than the run that reads it (made before the run took its folder's
lock: left by a run that was killed before it saw it) is stale: it is removed, not
honoured. One made while the run starts up stops it after its first round.

A run can also pause by itself at a time given in advance (run-config ``stop-by``, a
machine's or a job's working time): after each round it pauses when the next round
would end after that time, reckoning a round as long as the longest of its last
:data:`ROUNDS_MEASURED` rounds (:func:`next_round_ends_after`). The first round of a
run, or of a resumed segment, counts its start-up too, so the reckoning errs early.
"""

from __future__ import annotations

import json
import os
import socket
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path

from fedspc_app.core.files import atomic_write

PAUSE_REQUEST = "pause-request.json"
ROUNDS_MEASURED = 3
"""The rounds whose longest predicts the next one, for ``stop-by``."""
STOP_BY = "stop-by"


class RunPaused(Exception):  # a pause is an outcome, not an error
    """A run stopped at a round boundary on request; its checkpoint continues it."""

    def __init__(self, after_round: int, num_rounds: int | None = None,
                 run_name: str = "", reason: str = "") -> None:
        self.after_round = after_round
        self.num_rounds = num_rounds
        self.run_name = run_name
        self.reason = reason  # "" (a request), or "stop-by <time>"
        of = f" of {num_rounds}" if num_rounds else ""
        name = f"run {run_name!r} " if run_name else "the run "
        why = f" ({reason})" if reason else ""
        super().__init__(f"{name}paused after round {after_round}{of}{why}")


def next_round_ends_after(deadline: float, now: float, round_ends: list[float]) -> bool:
    """Whether a round started ``now`` would end after ``deadline`` (all three
    ``time.time()`` values). ``round_ends``: when the run (or its segment) started, then
    the end of each of its rounds since; the next round is reckoned as long as the
    longest of the last :data:`ROUNDS_MEASURED`."""
    recent = round_ends[-(ROUNDS_MEASURED + 1):]
    longest = max((b - a for a, b in pairwise(recent)), default=0.0)
    return now + longest > deadline


def request_pause(folder: str | os.PathLike[str]) -> Path:
    """Write a pause request in ``folder``; return its path."""
    path = Path(folder) / PAUSE_REQUEST
    atomic_write(path, json.dumps({
        "requested-at": datetime.now(UTC).isoformat(timespec="seconds"),
        "pid": os.getpid(), "host": socket.gethostname()}) + "\n")
    return path


def pause_requested(folder: str | os.PathLike[str], since: float) -> bool:
    """Whether ``folder`` holds a pause request written at or after ``since`` (a
    ``time.time()``); an older one is stale and removed."""
    path = Path(folder) / PAUSE_REQUEST
    try:
        written = path.stat().st_mtime
    except OSError:
        return False
    if written < since:
        clear_pause(folder)
        return False
    return True


def clear_pause(folder: str | os.PathLike[str]) -> bool:
    """Remove ``folder``'s pause request; whether there was one."""
    try:
        (Path(folder) / PAUSE_REQUEST).unlink()
    except FileNotFoundError:
        return False
    return True
