"""Pausing a run, or a grid of runs, at a round boundary.

A pause request is a small file, :data:`PAUSE_REQUEST`, in a run's results folder
(or a grid's folder). The ServerApp looks for it after each round's checkpoint: it
then ends the run there, its summary saying ``"paused-after-round": N``, and the
run continues from that checkpoint when started again with ``resume = true``. A
grid's runner looks for its own request between cells. Requests are written by
``python -m fedspc_app.experiments pause`` and removed by whoever honours them.

A request older than the process that reads it (left by a run that was killed
before it saw it) is stale: it is removed, not honoured.
"""

from __future__ import annotations

import json
import os
import socket
from datetime import UTC, datetime
from pathlib import Path

from fedspc_app.core.files import atomic_write

PAUSE_REQUEST = "pause-request.json"


class RunPaused(Exception):  # a pause is an outcome, not an error
    """A run stopped at a round boundary on request; its checkpoint continues it."""

    def __init__(self, after_round: int, num_rounds: int | None = None,
                 run_name: str = "") -> None:
        self.after_round = after_round
        self.num_rounds = num_rounds
        self.run_name = run_name
        of = f" of {num_rounds}" if num_rounds else ""
        name = f"run {run_name!r} " if run_name else "the run "
        super().__init__(f"{name}paused after round {after_round}{of}")


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
