"""Virtual time for code that waits: ``sleep`` advances it at once and is recorded."""

from __future__ import annotations


class Clock:
    """Stands in for the ``time`` module of the code under test (``monotonic``, ``sleep``)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
