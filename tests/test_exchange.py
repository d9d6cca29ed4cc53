"""How the round loop sends messages and collects replies (strategies.rounds.exchange)."""

from __future__ import annotations

import itertools

import pytest
from flwr.app import Message, MessageType, MetricRecord, RecordDict
from virtual_clock import Clock

from fedspc_app.core import startup
from strategies import rounds
from strategies.rounds import exchange, expected_seconds

pytestmark = pytest.mark.usefixtures("task_identity")
_ids = itertools.count(1)


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(rounds, "time", clock)
    return clock


def message(node: int) -> Message:
    return Message(content=RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)


class ScriptedGrid:
    """Records each push; a message's reply becomes readable ``delay[node]`` seconds
    after its push (never, for a node in ``silent``)."""

    def __init__(self, clock: Clock, delay: dict[int, float] | None = None,
                 silent=()) -> None:
        self.clock = clock
        self.delay = delay or {}
        self.silent = set(silent)
        self.waves: list[list[int]] = []
        self.ready: dict[str, tuple[float, Message]] = {}
        self.pulls = 0

    def push_messages(self, messages):
        ids, wave = [], []
        for m in messages:
            message_id = f"m{next(_ids)}"
            m.metadata.__dict__["_message_id"] = message_id
            node = m.metadata.dst_node_id
            wave.append(node)
            ids.append(message_id)
            if node not in self.silent:
                reply = Message(RecordDict({"metrics": MetricRecord({"work-seconds": 1.0})}),
                                reply_to=m)
                self.ready[message_id] = (self.clock.now + self.delay.get(node, 0.0), reply)
        self.waves.append(wave)
        return ids

    def pull_messages(self, message_ids):
        self.pulls += 1
        out = [i for i in message_ids
               if i in self.ready and self.ready[i][0] <= self.clock.now]
        return [self.ready.pop(i)[1] for i in out]


def test_without_history_every_message_goes_in_one_push(clock):
    grid = ScriptedGrid(clock)
    replies = exchange(grid, [message(n) for n in (1, 2, 3)], timeout=5)
    assert grid.waves == [[1, 2, 3]]
    assert len(replies) == 3


def test_longest_first_one_wave_each_and_nodes_without_history_count_as_long(clock):
    grid = ScriptedGrid(clock)
    expected = {1: 1.0, 2: 9.0, 3: 5.0, 4: 2.0}  # node 5 has no history
    exchange(grid, [message(n) for n in (1, 2, 3, 4, 5)], timeout=5, expected=expected,
             wave_gap=0.15)
    assert grid.waves == [[5], [2], [3], [4], [1]]
    assert clock.sleeps[:4] == [0.15] * 4  # one gap before each later wave


def test_short_messages_go_out_in_fewer_waves(clock):
    grid = ScriptedGrid(clock)
    # The longest is 0.7 s: the gaps may add up to 0.175 s, one gap of 0.15 s.
    expected = {1: 0.3, 2: 0.7, 3: 0.5, 4: 0.4}
    exchange(grid, [message(n) for n in (1, 2, 3, 4)], timeout=5, expected=expected,
             wave_gap=0.15)
    assert grid.waves == [[2, 3], [4, 1]]


def test_more_messages_than_waves_are_cut_into_near_equal_waves_longest_first(clock):
    grid = ScriptedGrid(clock)
    expected = {n: float(n) for n in range(1, 8)}
    exchange(grid, [message(n) for n in range(1, 8)], timeout=5, expected=expected,
             max_waves=3)
    assert grid.waves == [[7, 6, 5], [4, 3], [2, 1]]


class EngineGrid:
    """Flower's simulation engine as far as the order of work goes: every
    ``sweep`` seconds (first at ``offset``) it queues the messages pushed since its
    last look, in node order; ``workers`` workers take the queue first in, first out
    and need ``seconds[node]`` for a message."""

    def __init__(self, clock: Clock, seconds: dict[int, float], workers: int = 2,
                 sweep: float = 0.1, offset: float = 0.03) -> None:
        self.clock, self.seconds, self.workers = clock, seconds, workers
        self.sweep, self.offset = sweep, offset
        self.pushed: list[tuple[float, int, Message, str]] = []
        self.done: dict[str, tuple[float, Message]] | None = None

    def push_messages(self, messages):
        ids = []
        for m in messages:
            message_id = f"m{next(_ids)}"
            m.metadata.__dict__["_message_id"] = message_id
            self.pushed.append((self.clock.now, m.metadata.dst_node_id, m, message_id))
            ids.append(message_id)
        return ids

    def _run(self) -> dict[str, tuple[float, Message]]:
        queue, seen, sweep_at = [], set(), self.offset
        while len(seen) < len(self.pushed):
            found = sorted((node, t, m, i) for t, node, m, i in self.pushed
                           if t <= sweep_at and i not in seen)
            queue += [(sweep_at, node, m, i) for node, _, m, i in found]
            seen.update(i for *_, i in found)
            sweep_at += self.sweep
        free = [0.0] * self.workers
        done = {}
        for queued_at, node, m, message_id in queue:
            worker = min(range(self.workers), key=free.__getitem__)
            free[worker] = max(free[worker], queued_at) + self.seconds[node]
            reply = Message(RecordDict({"metrics": MetricRecord(
                {"setup-seconds": 0.0, "work-seconds": self.seconds[node]})}), reply_to=m)
            done[message_id] = (free[worker], reply)
        return done

    def pull_messages(self, message_ids):
        if self.done is None:
            self.done = self._run()
        out = [i for i in message_ids if i in self.done and self.done[i][0] <= self.clock.now]
        return [self.done.pop(i)[1] for i in out]


def test_longest_first_keeps_the_engines_workers_busy_to_the_end_of_the_phase(clock):
    # A client's seconds in proportion to its training images under the CIFAR-100
    # partition of the speed benchmark (10 clients, alpha = 0.1, seed 0), 2 workers.
    images = [5097, 5691, 6903, 3273, 5559, 4160, 6650, 3956, 3697, 5014]
    seconds = {node: n / 1150 for node, n in enumerate(images, start=1)}
    perfect = sum(seconds.values()) / 2

    def phase(expected):
        grid = EngineGrid(clock, seconds)
        started = clock.now
        replies = exchange(grid, [message(n) for n in seconds], timeout=None,
                           expected=expected, pull_interval=0.01)
        assert len(replies) == len(seconds)
        return clock.now - started, replies

    in_node_order, replies = phase(None)  # round 1: no history
    durations: dict[int, float] = {}
    rounds.record_durations(durations, replies)
    assert durations == pytest.approx(seconds)
    longest_first, _ = phase(durations)
    assert in_node_order > 1.04 * perfect
    # Ten waves 0.15 s apart cost the second worker one gap at the start.
    assert longest_first < 1.01 * perfect + 0.15
    assert longest_first < in_node_order - 0.7


def test_replies_are_pulled_until_all_came_without_waiting_seconds_between_pulls(clock):
    grid = ScriptedGrid(clock, delay={1: 0.0, 2: 0.3})
    replies = exchange(grid, [message(1), message(2)], timeout=10, pull_interval=0.05)
    assert len(replies) == 2
    # Flower's grid would wait 3 s between pulls; here it is pull_interval, and the
    # loop stops at the first pull that finds the last reply.
    assert set(clock.sleeps) == {0.05}
    assert 0.3 <= clock.now < 0.35 + 1e-9
    assert grid.pulls == len(clock.sleeps) + 1


def test_the_timeout_returns_the_replies_that_came(clock):
    grid = ScriptedGrid(clock, silent={2})
    replies = exchange(grid, [message(1), message(2)], timeout=0.5, pull_interval=0.05)
    assert len(replies) == 1  # node 2 never replied
    assert 0.5 - 1e-9 <= clock.now < 0.55 + 1e-9


def test_the_last_pull_is_at_the_deadline_not_an_interval_after_it(clock):
    """A padded phase's reserve below dp-phase-seconds need not hold a pull interval
    beyond round-timeout: the wait before the last pull is cut to the deadline."""
    grid = ScriptedGrid(clock, silent={2})
    replies = exchange(grid, [message(1), message(2)], timeout=0.25, pull_interval=0.1)
    assert len(replies) == 1
    assert clock.now == pytest.approx(0.25)
    assert max(clock.sleeps) == pytest.approx(0.1) and min(clock.sleeps) == pytest.approx(0.05)


def test_expected_seconds_reads_setup_and_work():
    reply = Message(RecordDict({"metrics": MetricRecord({"setup-seconds": 0.5,
                                                         "work-seconds": 2.0})}),
                    reply_to=_with_id(message(1)))
    assert expected_seconds(reply) == 2.5
    bare = Message(RecordDict({"metrics": MetricRecord({"work-seconds": 2.0})}),
                   reply_to=_with_id(message(1)))
    assert expected_seconds(bare) is None


def _with_id(m: Message) -> Message:
    m.metadata.__dict__["_message_id"] = f"m{next(_ids)}"
    return m


def _timed_reply(**metrics) -> Message:
    return Message(RecordDict({"metrics": MetricRecord(metrics)}),
                   reply_to=_with_id(message(1)))


def test_worker_startup_is_read_from_the_replies_to_a_process_first_message():
    sent = 1_000_000.0
    replies = [
        _timed_reply(**{"process-started-at": sent + 2.5, "handler-started-at": sent + 4.0,
                        "app-import-started-at": sent + 2.75, "app-imported-at": sent + 3.5}),
        _timed_reply(**{"process-started-at": sent - 60.0, "handler-started-at": sent + 0.5,
                        "app-import-started-at": sent - 59.0, "app-imported-at": sent - 58.0}),
        _timed_reply(**{"work-seconds": 3.0}),  # a process's later message
    ]
    assert startup.worker_startup(replies, sent) == {"worker-start-seconds": 2.5,
                                                    "worker-ready-seconds": 4.0,
                                                    "worker-import-seconds": 1.0,
                                                    "worker-imported-seconds": 3.5}
    assert startup.worker_startup(replies[2:], sent) == {}


def test_under_privacy_the_training_messages_go_out_in_one_wave(clock):
    # With waves, the gap before a drawn client's message would count the other drawn
    # clients ahead of it: colluders could read another client's draw from it.
    class Private:
        privacy = object()

    class Plain:
        privacy = None

    durations = {1: 1.0, 2: 9.0, 3: 5.0}
    assert rounds.train_order(Plain(), durations) is durations
    assert rounds.train_order(Private(), durations) is None
    grid = ScriptedGrid(clock)
    exchange(grid, [message(n) for n in (1, 2, 3)], timeout=5,
             expected=rounds.train_order(Private(), durations))
    assert grid.waves == [[1, 2, 3]]
