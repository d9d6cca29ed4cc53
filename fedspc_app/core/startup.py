"""How long a worker process takes to come up: measured on the client, read on the server.

The first message a ClientApp process handles carries, in its reply's metrics, when
the process started, when it began and finished importing the ClientApp, and when the
handler started (:func:`first_message_times`; wall-clock epochs). The server turns the
replies of a phase into how long the new workers took (:func:`worker_startup`): the
round loop records it for a round that met new workers, the simulation's warm-up
(:mod:`fedspc_app.server.warm_up`) in config.json. Meaningful where server and clients share a
clock (a simulation, one machine).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from flwr.app import Message

from fedspc_app.core.protocol import (
    APP_IMPORT_STARTED_AT,
    APP_IMPORTED_AT,
    HANDLER_STARTED_AT,
    PROCESS_STARTED_AT,
)
from fedspc_app.core.records import reply_metrics
from fedspc_app.core.replies import STARTUP

# In a phase that met new ClientApp processes (a simulation's round 1): seconds from
# sending its messages until the last new process had started, and until the last
# one began handling its first message (see worker_startup).
WORKER_START_SECONDS, WORKER_READY_SECONDS = "worker-start-seconds", "worker-ready-seconds"
# Of those: the longest a new process took to import the ClientApp module, and
# seconds from sending until the last had imported it.
WORKER_IMPORT_SECONDS, WORKER_IMPORTED_SECONDS = "worker-import-seconds", "worker-imported-seconds"


def process_started_at() -> float | None:
    """This process's start as a wall-clock epoch (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            # Field 22, counted after the parenthesised command name: clock ticks
            # since boot.
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        # The process's age on the clock of its start (seconds since boot, as
        # /proc/uptime counts them), taken from now: the boot time /proc/stat gives is
        # whole seconds and drifts from the wall clock over a long uptime.
        with open("/proc/uptime", encoding="ascii") as uptime:
            since_boot = float(uptime.read().split()[0])
        now = time.time()
        return now - max(0.0, since_boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


_FIRST_MESSAGE = {"pending": True}


def first_message_times(handler_started_at: float, import_started_at: float,
                        imported_at: float) -> dict[str, float]:
    """On the first message this process handles: when the process started, when it
    began and finished importing the ClientApp (``import_started_at``, ``imported_at``)
    and when the handler started (wall-clock epochs); on later messages nothing."""
    if not _FIRST_MESSAGE["pending"]:
        return {}
    _FIRST_MESSAGE["pending"] = False
    started = process_started_at()
    times = {HANDLER_STARTED_AT: handler_started_at,
             APP_IMPORT_STARTED_AT: import_started_at, APP_IMPORTED_AT: imported_at}
    if started is not None:
        # The boot clock's estimate, never after a moment the wall clock saw this
        # process alive (the two disagree after the wall clock was stepped).
        times[PROCESS_STARTED_AT] = min(started, import_started_at)
    return times


def worker_startup(replies: Iterable[Message], sent_at: float) -> dict[str, float]:
    """How long the new ClientApp processes of a phase sent at ``sent_at`` (a
    wall-clock epoch) took to come up, from the replies to their first message.

    ``worker-start-seconds``: until the last of them had started (0 for processes
    that were already running: in a simulation, Ray and its workers starting);
    ``worker-ready-seconds``: until the last began its first handler (the start, then
    loading the ClientApp and its imports, and waiting for a message);
    ``worker-import-seconds``: the longest any of them spent importing the ClientApp
    module, and ``worker-imported-seconds``: until the last had imported it (both
    part of the time to ready). Empty when no reply is a process's first.
    Both sides must share a clock: a simulation.
    """
    started, ready, imports, imported = [], [], [], []
    for reply in replies:
        metrics = reply_metrics(reply)
        # Each time as the reply schema reads it (None: absent or not a valid epoch).
        handler, process, began, done = (STARTUP[key].read(metrics) for key in (
            HANDLER_STARTED_AT, PROCESS_STARTED_AT, APP_IMPORT_STARTED_AT, APP_IMPORTED_AT))
        if handler is None:
            continue
        ready.append(max(0.0, handler - sent_at))
        if process is not None:
            started.append(max(0.0, process - sent_at))
        if began is not None and done is not None:
            imports.append(max(0.0, done - began))
            imported.append(max(0.0, done - sent_at))
    out = {}
    if started:
        out[WORKER_START_SECONDS] = max(started)
    if ready:
        out[WORKER_READY_SECONDS] = max(ready)
    if imports:
        out[WORKER_IMPORT_SECONDS] = max(imports)
        out[WORKER_IMPORTED_SECONDS] = max(imported)
    return out
