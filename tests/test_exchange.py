"""How the round loop sends messages and collects replies (strategies.rounds.exchange)."""

from __future__ import annotations

import itertools

import pytest
from flwr.app import Message, MessageType, MetricRecord, RecordDict
from virtual_clock import Clock

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


def test_longer_half_first_and_nodes_without_history_count_as_long(clock):
    grid = ScriptedGrid(clock)
    expected = {1: 1.0, 2: 9.0, 3: 5.0, 4: 2.0}  # node 5 has no history
    exchange(grid, [message(n) for n in (1, 2, 3, 4, 5)], timeout=5, expected=expected,
             second_wave_after=0.15)
    assert grid.waves == [[5, 2, 3], [4, 1]]
    assert clock.sleeps[0] == 0.15  # the short half goes out after this pause


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
