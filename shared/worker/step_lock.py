"""The lock a worker's engine loop holds around each step, which other threads (the heartbeat, a model
load) still get between steps.

A plain lock is not enough: the loop releases it and takes it again a few hundred nanoseconds later,
and whichever thread the kernel runs first wins. On the H200 host the loop won every time, so the
heartbeat thread never published again and the gateway declared a busy prefill worker dead ten seconds
after it started ("no live prefill worker"). Here a waiting thread makes the loop's next ``turn()``
wait until that thread holds the lock, so it gets in after at most the step in progress.
"""

import contextlib
import threading
import time
from collections.abc import Iterator


class StepLock:
    """Re-entrant. ``with lock:`` is for other threads, ``with lock.turn():`` for the engine loop."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._cond = threading.Condition(threading.Lock())
        self._waiting = 0  # threads other than the loop queued for the lock
        self._owner: int | None = None
        self._depth = 0
        self.turn_since: float | None = None  # time.monotonic() when the loop's turn in progress began
        self.wait_since: float | None = None  # when the loop began waiting for its turn (another thread holds it)

    def turn_age(self) -> float:
        """Seconds the loop's turn in progress has run; 0 between turns and while the loop waits for one. A turn
        of a working loop ends within a step, an idle one's within its wait for a job (intake.py). The wait is left
        out: the thread the loop waits for holds the lock for work of its own (a model load building its engine or
        capturing CUDA graphs, a warm-up shape), which says nothing of the loop's steps; one holding it for ever
        is the stall watch's to end (``wait_since``, shared/worker/stall_watch.py)."""
        since = self.turn_since
        return 0.0 if since is None else max(time.monotonic() - since, 0.0)

    def acquire(self) -> bool:
        if self._owner == threading.get_ident():
            self._take()
            return True
        with self._cond:
            self._waiting += 1
        try:
            self._take()
        finally:
            with self._cond:
                self._waiting -= 1
                self._cond.notify_all()
        return True

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """The loop's hold for one step: first lets every thread already waiting have the lock."""
        if self._owner != threading.get_ident():
            self.wait_since = time.monotonic()
            with self._cond:
                self._cond.wait_for(lambda: self._waiting == 0)
            self._take()
            self.wait_since = None
        else:
            self._take()
        outer = self._depth == 1
        if outer:
            self.turn_since = time.monotonic()
        try:
            yield
        finally:
            if outer:
                self.turn_since = None
            self.release()

    def _take(self) -> None:
        self._lock.acquire()
        self._owner = threading.get_ident()
        self._depth += 1


class LockedPool:
    """The pool as a loading thread sees it: attach and detach wait for the worker loop's step to end."""

    def __init__(self, pool, lock: StepLock):
        self._pool, self._lock = pool, lock

    def __getattr__(self, name: str):
        attr = getattr(self._pool, name)
        if name not in ("attach", "detach", "grow"):
            return attr

        def locked(*args, **kwargs):
            with self._lock:
                return attr(*args, **kwargs)

        return locked
