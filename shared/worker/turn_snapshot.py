"""A value the engine loop takes for another thread at the end of a turn, while it still holds the step lock,
so that thread never waits for a step (one can outlast the registration's TTL, or the time after which
peers reclaim a job) and never reads what a step is halfway through changing.

The thread asks with ``latest(wait_s)``: the turn in progress takes a snapshot as it ends, and the thread
waits up to ``wait_s`` for it; a longer step leaves it the last one taken, at most a step old. Asked for
only, not every turn: taking one may cost more than a fast step should pay each time.
"""

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class TurnSnapshot(Generic[T]):
    def __init__(self, take: Callable[[], T]) -> None:
        """``take``: builds the value; run with the step lock held (by the loop, or ``take_now``'s caller)."""
        self._take = take
        self._value: T | None = None  # replaced whole, never changed
        self._wanted = False
        self._fresh = threading.Event()

    def take_now(self) -> T:
        """Take it now: the caller holds the step lock."""
        self._value = value = self._take()
        self._fresh.set()
        return value

    def turn_ended(self) -> None:
        """The engine loop, at the end of a turn, holding the step lock."""
        if self._wanted:
            self._wanted = False
            self.take_now()

    def latest(self, wait_s: float) -> T | None:
        """The one the turn in progress takes, if it ends within ``wait_s``, else the last taken (None: none yet)."""
        self._fresh.clear()
        self._wanted = True
        self._fresh.wait(wait_s)
        return self._value
