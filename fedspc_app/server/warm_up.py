"""A simulation's clients come up while the server prepares.

Round 1 of a simulation otherwise pays for Ray starting its worker processes, each
importing torch and the ClientApp and loading its data (about 5 s on two cores, the
same again per worker on a busy machine) while the server already waits on the
clients. :func:`start` sends every node one small query (``WARM_UP_QUERY``: the worker
loads what round 1 would load) before the server loads its own data and builds its
model, so both happen at once; :func:`finish` collects the replies before round 1. A
deployment's SuperNodes start a process per message, so there it would warm nothing:
the preflight check (:mod:`fedspc_app.server.deployment`) loads their data instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from logging import INFO, WARNING

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from fedspc_app.core.protocol import CONFIG, NUM_CLIENTS, QUERY, WARM_UP_QUERY
from fedspc_app.core.startup import worker_startup


@dataclass
class WarmUp:
    """The warm-up messages in flight: their ids and when they were sent."""

    waiting: set[str]
    sent_at: float  # wall clock, as the replies' process timings
    started: float  # monotonic
    # The replies, once finished: each names its node's partition (the strategy binds
    # the nodes to them before round 1, see strategies.sampling).
    answers: list[Message] = field(default_factory=list)


def start(grid: Grid, num_clients: int) -> WarmUp:
    """Send every connected node the warm-up query; do not wait. ``num_clients``: the
    run-config's (0: each node's own ``num-partitions``)."""
    config = {QUERY: WARM_UP_QUERY, **({NUM_CLIENTS: num_clients} if num_clients else {})}
    messages = [Message(RecordDict({CONFIG: ConfigRecord(config)}), dst_node_id=node_id,
                        message_type=MessageType.QUERY)
                for node_id in sorted(grid.get_node_ids())]
    sent_at, started = time.time(), time.monotonic()
    return WarmUp(set(grid.push_messages(messages)), sent_at, started)


def finish(grid: Grid, warm_up: WarmUp, timeout: float) -> dict[str, float]:
    """Wait for the warm-up replies (at most ``timeout`` seconds from the send).

    Returns what the run records of it: seconds from the send until every reply was
    in (``seconds``), seconds the server waited for them after its own preparation
    (``waited-seconds``), and the new worker processes' start-up
    (:func:`fedspc_app.core.startup.worker_startup`). A failed warm-up is logged and not
    fatal: round 1 meets the same problem and the round failure policy reports it.
    """
    waited_from = time.monotonic()
    replies: list[Message] = []
    while warm_up.waiting and time.monotonic() - warm_up.started < timeout:
        pulled = list(grid.pull_messages(warm_up.waiting))
        replies.extend(pulled)
        warm_up.waiting.difference_update(m.metadata.reply_to_message_id for m in pulled)
        if warm_up.waiting:
            time.sleep(0.05)
    warm_up.answers = replies
    failed = [reply for reply in replies if reply.has_error()]
    if failed:
        log(WARNING, "%d client(s) failed to warm up (round 1 will retry): %s",
            len(failed), failed[0].error.reason)
    if warm_up.waiting:
        log(WARNING, "%d client(s) did not answer the warm-up within %.0f s",
            len(warm_up.waiting), timeout)
    now = time.monotonic()
    record = {"seconds": round(now - warm_up.started, 3),
              "waited-seconds": round(now - waited_from, 3),
              **{key: round(value, 3)
                 for key, value in worker_startup(replies, warm_up.sent_at).items()}}
    log(INFO, "Clients warmed up %.1f s after the send (the server waited %.1f s for them "
        "after its own preparation)", record["seconds"], record["waited-seconds"])
    return record
