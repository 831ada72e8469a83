"""The lock a worker's engine loop holds around each step, which other threads (the heartbeat, a model
load) still get between steps, and which a model load takes in pieces so the loop steps between them.

A plain lock is not enough, either way round: a thread that releases it and takes it again a few
microseconds later wins against one the kernel still has to wake. On the H200 host the loop won every
time, so the heartbeat thread never published again and the gateway declared a busy prefill worker dead
ten seconds after it started ("no live prefill worker"); a model load taking it per warm-up shape wins the
same way, and the co-resident models do not step until the whole warm-up is done. So the lock decides who
goes next: a thread waiting for it makes the loop's next ``turn()`` wait until that thread has had it, and a
loop waiting for its turn goes before that thread (or any other) takes it again. Contended, the loop and the
others alternate: a step, a piece of the load, a step.
"""

import contextlib
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from time import perf_counter


class StepLock:
    """Re-entrant. ``with lock:`` is for other threads, ``with lock.turn():`` for the engine loop."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())  # guards every field below
        self._owner: int | None = None
        self._depth = 0
        self._waiting = 0  # threads other than the loop queued for the lock
        self._loop_waiting = False  # the loop is queued for its turn
        self._loop_due = False  # the loop waited through another thread's hold: it goes before any other
        self.turn_since: float | None = None  # time.monotonic() when the loop's turn in progress began
        self.wait_since: float | None = None  # when the loop began waiting for its turn (another thread holds it)

    def turn_age(self) -> float:
        """Seconds the loop's turn in progress has run; 0 between turns and while the loop waits for one. A turn
        of a working loop ends within a step, an idle one's within its wait for a job (intake.py). The wait is left
        out: the thread the loop waits for holds the lock for work of its own (a piece of a model load: its pool
        attach, one CUDA graph's capture, a warm-up shape), which says nothing of the loop's steps; one holding it
        for ever is the stall watch's to end (``wait_since``, shared/worker/stall_watch.py)."""
        since = self.turn_since
        return 0.0 if since is None else max(time.monotonic() - since, 0.0)

    def acquire(self) -> bool:
        me = threading.get_ident()
        with self._cond:
            if self._owner != me:
                self._waiting += 1
                try:
                    self._cond.wait_for(lambda: self._owner is None and not self._loop_due)
                finally:
                    self._waiting -= 1
                self._owner = me
            self._depth += 1
        return True

    def release(self) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth:
                return
            self._owner = None
            if self._loop_waiting:  # another thread's hold ended (the loop's own never does while it waits)
                self._loop_due = True
            self._cond.notify_all()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """The loop's hold for one step: first lets every thread already waiting have the lock."""
        me = threading.get_ident()
        with self._cond:
            if self._owner != me:
                self.wait_since = time.monotonic()
                self._loop_waiting = True
                try:
                    self._cond.wait_for(lambda: self._owner is None and (self._waiting == 0 or self._loop_due))
                finally:
                    self._loop_waiting = self._loop_due = False
                    self._cond.notify_all()  # others held back for the loop wait again for the lock itself
                self._owner = me
                self.wait_since = None
            self._depth += 1
            outer = self._depth == 1
            if outer:
                self.turn_since = time.monotonic()
        try:
            yield
        finally:
            if outer:
                self.turn_since = None
            self.release()


class LockedPool:
    """The pool as a loading thread sees it: attach and detach wait for the worker loop's step to end.
    ``lock``: the step lock, or a context that takes it (HoldTimes.hold)."""

    def __init__(self, pool, lock: AbstractContextManager):
        self._pool, self._lock = pool, lock

    def __getattr__(self, name: str):
        attr = getattr(self._pool, name)
        if name not in ("attach", "detach", "grow"):
            return attr

        def locked(*args, **kwargs):
            with self._lock:
                return attr(*args, **kwargs)

        return locked


class HoldTimes:
    """Every hold of a step lock by one thread (a model load), each timed on its own and labelled with the phase
    of the load it was taken for: what a co-resident model's step may have waited for. The load takes the lock
    only through ``hold(phase)``; a hold nested in another counts as part of the outer one; other threads taking
    it through the same contexts (the loop growing the loaded model's KV through its LockedPool, for as long as
    the model lives) pass through untimed, as does every thread once ``done()``."""

    def __init__(self, lock: StepLock):
        self.lock = lock
        self.thread: int | None = threading.get_ident()
        self.holds: list[tuple[str, float]] = []  # (phase, seconds), in the order they ended
        self._depth = 0
        self._since = 0.0

    def hold(self, phase: str) -> "TimedHold":
        return TimedHold(self, phase)

    def done(self) -> None:
        self.thread = None

    def longest(self) -> tuple[str, float]:
        """(phase, seconds) of the longest hold; ("", 0.0) when none was taken."""
        return max(self.holds, key=lambda h: h[1], default=("", 0.0))

    def total(self) -> float:
        return sum(s for _, s in self.holds)

    def by_phase(self) -> dict[str, list[float]]:
        phases: dict[str, list[float]] = {}
        for phase, seconds in self.holds:
            phases.setdefault(phase, []).append(seconds)
        return phases

    def describe(self) -> str:
        """One line: the longest hold and the total, then each phase's count, longest and total."""
        phase, longest = self.longest()
        parts = [f"{p} {len(s)} x, longest {max(s):.3f} s, total {sum(s):.3f} s" for p, s in self.by_phase().items()]
        return (f"longest {longest:.3f} s ({phase or 'none taken'}), total {self.total():.3f} s in {len(self.holds)} "
                f"holds" + (f" ({'; '.join(parts)})" if parts else ""))


class TimedHold(AbstractContextManager):
    """The step lock taken for one phase of a load (HoldTimes.hold); reusable and re-entrant, as the lock is."""

    def __init__(self, times: HoldTimes, phase: str):
        self.times, self.phase = times, phase

    def __enter__(self) -> "TimedHold":
        t = self.times
        t.lock.acquire()
        if threading.get_ident() == t.thread:
            if t._depth == 0:
                t._since = perf_counter()
            t._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        t = self.times
        if t._depth and threading.get_ident() == t.thread:
            t._depth -= 1
            if t._depth == 0:
                t.holds.append((self.phase, perf_counter() - t._since))
        t.lock.release()
