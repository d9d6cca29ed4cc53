"""The round loop, with a failure policy and a hook for checkpoints.

Flower's ``Strategy.start`` always runs rounds 1..N; this loop can start at any
round (a resumed run), lets a round fail without ending the run, and calls back
after each round's aggregation (``on_trained``: the point where a checkpoint makes
the round's decisions durable) and after its evaluation (``on_round_end``). The
strategy hooks it calls are Flower's: configure/aggregate train and evaluate.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from logging import INFO, WARNING

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.supercore import log
from flwr.supercore.logger import FLOWER_LOGGER

from fedspc_app.core.errors import FedSPCError
from fedspc_app.core.phase_timing import REPLY_POLL_SECONDS
from fedspc_app.core.records import reply_metrics
from fedspc_app.core.replies import TIMING_METRICS
from fedspc_app.core.startup import worker_startup
from strategies.personalized import RoundReport

Trained = Callable[[int, ArrayRecord, MetricRecord | None, RoundReport], None]
RoundEnd = Callable[[int, MetricRecord | None, MetricRecord | None, RoundReport | None], None]


# Wall seconds of a round's training or evaluation phase: from sending the messages
# to the end of the aggregation.
PHASE_SECONDS = "phase-seconds"
class TooManyFailedRounds(FedSPCError):
    """``max-failed-rounds`` rounds in a row failed."""


class PhasePadding:
    """Under differential privacy, ``dp-phase-seconds`` = T: a training phase, from just
    before its messages are made to the end of its aggregation, lasts T seconds whoever
    was drawn, so that nothing observable after it (the messages' ``created_at``, the
    files' times, W&B's ``_runtime``, the log's times) tells how many clients a round
    drew, which a phase's duration grows with. A phase that outlasts T is not padded
    (one warning the first time, and a count at the end of the run)."""

    clock = staticmethod(time.perf_counter)
    sleep = staticmethod(time.sleep)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.overruns = 0  # rounds whose training phase outlasted T

    def wait(self, started: float) -> float:
        """Sleep until ``started`` (the :attr:`clock`'s time before the phase's messages
        were made) + T; return the seconds slept, 0 when the phase took longer."""
        left = started + self.seconds - self.clock()
        if left > 0:
            self.sleep(left)
            return left
        self.overruns += 1
        if self.overruns == 1:
            log(WARNING, "A training phase outlasted dp-phase-seconds = %g: its time, and "
                "what follows it, can tell how many clients the round drew; set "
                "dp-phase-seconds above the slowest phase you expect", self.seconds)
        return 0.0


class HeldRecords(logging.Filter):
    """Keeps the records of the logger it filters instead of passing them on."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


@contextlib.contextmanager
def held_logs(active: bool = True) -> Iterator[None]:
    """Flower's log records made inside (any thread's) go out when it ends, stamped with
    that time: a padded phase's records (a dropped reply's warning at its aggregation)
    would otherwise tell when in the phase they happened."""
    if not active:
        yield
        return
    held = HeldRecords()
    FLOWER_LOGGER.addFilter(held)
    try:
        yield
    finally:
        FLOWER_LOGGER.removeFilter(held)
        now = time.time()
        for record in held.records:
            record.relativeCreated += (now - record.created) * 1000
            record.created, record.msecs = now, (now - int(now)) * 1000
            FLOWER_LOGGER.handle(record)


def expected_seconds(reply: Message) -> float | None:
    """A client's own seconds for a message (setup + work), from its reply's metrics."""
    metrics = reply_metrics(reply)
    values = [metric.read(metrics) for metric in TIMING_METRICS]
    if any(value is None for value in values):
        return None
    return float(sum(values))


def record_durations(durations: dict[int, float], replies: Iterable[Message]) -> None:
    for reply in replies:
        seconds = expected_seconds(reply)
        if seconds is not None:
            durations[reply.metadata.src_node_id] = seconds


def dispatch_waves(messages: list[Message], expected: Mapping[int, float] | None,
                   max_waves: int, wave_gap: float) -> list[list[Message]]:
    """``messages`` longest first (by ``expected``, a node's seconds for its last
    message of this kind), cut into at most ``max_waves`` waves of near-equal size.

    A node without a history counts as the longest; ties keep the given order. With
    no history at all there is nothing to order by: one wave. Short messages (an
    evaluation) gain little from the order and would wait on the gaps, so the
    ``wave_gap`` seconds between waves add up to at most a quarter of the longest
    expected message.
    """
    known = [expected[m.metadata.dst_node_id] for m in messages
             if expected and m.metadata.dst_node_id in expected]
    if known and wave_gap > 0:
        max_waves = min(max_waves, 1 + int(0.25 * max(known) / wave_gap))
    if not expected or len(messages) < 2 or max_waves < 2:
        return [messages] if messages else []
    ordered = sorted(messages,
                     key=lambda m: -expected.get(m.metadata.dst_node_id, math.inf))
    count = min(max_waves, len(ordered))
    size, extra = divmod(len(ordered), count)
    waves, start = [], 0
    for index in range(count):
        end = start + size + (1 if index < extra else 0)
        waves.append(ordered[start:end])
        start = end
    return waves


def train_order(strategy, durations: Mapping[int, float]) -> Mapping[int, float] | None:
    """What orders the training messages into waves: the nodes' last training times,
    or, under differential privacy, nothing (one wave): with waves, when a drawn
    client's message arrives would depend on which other clients were drawn."""
    return None if getattr(strategy, "privacy", None) is not None else durations


def exchange(grid: Grid, messages: Iterable[Message], *, timeout: float | None,
             expected: Mapping[int, float] | None = None,
             pull_interval: float = REPLY_POLL_SECONDS,
             wave_gap: float = 0.15, max_waves: int = 10) -> list[Message]:
    """Send ``messages`` and collect their replies until all came or ``timeout`` passed.

    Replies are pulled every ``pull_interval`` seconds (Flower's Grid waits 3 s
    between pulls in a deployment, which every round paid twice), the last pull at
    the deadline, not up to an interval after it.

    With ``expected`` (a node's seconds for its last message of this kind) the
    messages go out longest first, in up to ``max_waves`` waves ``wave_gap`` seconds
    apart (see ``dispatch_waves``). The simulation engine looks for new messages every
    0.1 s and queues those it finds in node order, so the gap makes its queue follow
    the sending order: its workers run the longest clients first and the shortest
    last, which keeps them all busy to the end of the phase (longest-processing-time
    first). The gaps add up to at most a quarter of the longest expected message, so
    short phases go out in fewer waves. In a deployment, where every node starts at
    once, the delay falls on the shortest clients. Returns the replies in the order
    they came.
    """
    waves = dispatch_waves(list(messages), expected, max_waves, wave_gap)
    deadline = None if timeout is None else time.monotonic() + timeout
    waiting: set[str] = set()
    for index, wave in enumerate(waves):
        if index:
            time.sleep(wave_gap)
        waiting.update(grid.push_messages(wave))
    replies: list[Message] = []
    while waiting:
        pulled = list(grid.pull_messages(waiting))
        replies.extend(pulled)
        waiting.difference_update(m.metadata.reply_to_message_id for m in pulled)
        if not waiting or (deadline is not None and time.monotonic() >= deadline):
            break
        time.sleep(pull_interval if deadline is None
                   else max(min(pull_interval, deadline - time.monotonic()), 0.0))
    return replies


def reply_timeout(timeout: float, padding: PhasePadding | None, started: float) -> float:
    """The seconds a training phase still waits for replies: ``round-timeout``, under
    padding counted from the phase's start (``started``, the padding's clock before
    its messages were made), so that making more messages for a larger draw does not
    push the deadline into the reserve ``round-timeout`` leaves below T
    (:mod:`fedspc_app.core.phase_timing`)."""
    if padding is None:
        return timeout
    return max(timeout - (padding.clock() - started), 0.0)


def run_rounds(strategy, grid: Grid, *, arrays: ArrayRecord, num_rounds: int,
               first_round: int = 1, evaluate_first: bool = False, timeout: float = 3600.0,
               train_config: ConfigRecord | None = None,
               evaluate_config: ConfigRecord | None = None,
               max_failed_rounds: int = 3, failed_streak: int = 0,
               resumed_train_metrics: MetricRecord | None = None,
               evaluate_every: int = 1, evaluate_fraction: float = 1.0,
               phase_seconds: float = 0.0,
               on_trained: Trained | None = None,
               on_round_end: RoundEnd | None = None) -> ArrayRecord:
    """Run rounds ``first_round..num_rounds``; return the final shared block.

    ``evaluate_first`` resumes a round whose aggregation was checkpointed but whose
    evaluation was not (``resumed_train_metrics``: that aggregation's metrics). A
    failed round (too few usable replies) keeps the shared block, skips evaluation
    and counts towards ``max_failed_rounds`` in a row. Clients are evaluated every
    ``evaluate_every`` rounds, a sampled ``evaluate_fraction`` of them, except in the
    last round, which evaluates every client. ``phase_seconds`` > 0 (differential
    privacy's ``dp-phase-seconds``) pads every training phase, its aggregation included,
    to that many seconds (:class:`PhasePadding`), holding the log's records until then.
    """
    padding = PhasePadding(phase_seconds) if phase_seconds > 0 else None
    train_config = train_config if train_config is not None else ConfigRecord()
    durations: dict[str, dict[int, float]] = {"train": {}, "evaluate": {}}
    evaluate_config = evaluate_config if evaluate_config is not None else ConfigRecord()
    for server_round in range(first_round, num_rounds + 1):
        log(INFO, "[ROUND %d/%d]", server_round, num_rounds)
        train_metrics = resumed_train_metrics
        if not (evaluate_first and server_round == first_round):
            started, sent_at = time.perf_counter(), time.time()
            padded_from = padding.clock() if padding is not None else 0.0
            with held_logs(padding is not None):
                messages = strategy.configure_train(server_round, arrays, train_config, grid)
                replies = exchange(grid, messages,
                                   timeout=reply_timeout(timeout, padding, padded_from),
                                   expected=train_order(strategy, durations["train"]))
                record_durations(durations["train"], replies)
                aggregated, train_metrics = strategy.aggregate_train(server_round, replies)
                if train_metrics is not None:
                    train_metrics[PHASE_SECONDS] = time.perf_counter() - started
                    train_metrics.update(worker_startup(replies, sent_at))
                if padding is not None:  # before anything is written or sent
                    padding.wait(padded_from)
            report = strategy.report
            if aggregated is not None:
                arrays = aggregated
            failed_streak = failed_streak + 1 if report.failed else 0
            if on_trained is not None:
                on_trained(server_round, arrays, train_metrics, report)
            strategy.durable_through = server_round
            if report.failed:
                if on_round_end is not None:
                    on_round_end(server_round, None, None, report)
                if failed_streak >= max_failed_rounds:
                    raise TooManyFailedRounds(
                        f"{failed_streak} rounds in a row failed (max-failed-rounds = "
                        f"{max_failed_rounds}); the last: " + "; ".join(report.reasons[:5]))
                continue
        last = server_round == num_rounds
        evaluate_metrics = None
        if last or server_round % evaluate_every == 0:
            strategy.fraction_evaluate = 1.0 if last else evaluate_fraction
            started, sent_at = time.perf_counter(), time.time()
            replies = exchange(
                grid, strategy.configure_evaluate(server_round, arrays, evaluate_config,
                                                  grid),
                timeout=timeout, expected=durations["evaluate"])
            record_durations(durations["evaluate"], replies)
            evaluate_metrics = strategy.aggregate_evaluate(server_round, replies)
            if evaluate_metrics is not None:
                evaluate_metrics[PHASE_SECONDS] = time.perf_counter() - started
                evaluate_metrics.update(worker_startup(replies, sent_at))
        if on_round_end is not None:
            on_round_end(server_round, train_metrics, evaluate_metrics, strategy.report)
        evaluate_first = False
    if padding is not None and padding.overruns:
        log(WARNING, "%d of the training phases outlasted dp-phase-seconds = %g",
            padding.overruns, phase_seconds)
    return arrays
