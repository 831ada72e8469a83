"""The worker's watch on its engine loop's steps: the bound on how long a worker that is alive but stuck keeps
its requests. The heartbeat does not wait for steps (registration.py), so a worker whose step never returns
stays registered, and no peer takes its requests, until something ends it: this watch, once a step has run
``step_timeout_s`` (--step-timeout, far above the longest legitimate step: a prompt's full chunk prefilled on
a CPU; compiles and CUDA graph captures happen in warm-up, before a model serves).

What it does then:
* a model split over rank processes (tensor or pipeline parallelism) whose rank stopped answering (stopped by
  a signal, wedged on its device) leaves rank 0 waiting in a collective until the collective's own timeout
  (shared/engine/parallel/state.py), and no rank died for the group's watchdog to see: the watch takes every
  rank group down, the step fails with ``TensorParallelError`` and the worker exits as when a rank dies
  (unregistered, non-zero, for its supervisor to restart; the gateway and peers run its requests again).
  Which model's step waits is not known here: every group goes, the worker is ending anyway.
* a step nothing can interrupt (a model in this process alone; or one whose groups went down and that still
  has not returned another ``step_timeout_s`` later): the watch unregisters the worker, so gateways and peers
  see it gone at once, and ends the process with STUCK_EXIT_CODE (``os._exit``: the loop's thread cannot be
  joined, and a clean shutdown would wait for it). Its supervisor restarts it; its unacknowledged jobs are
  reclaimed by peers and the requests it was decoding run again, as for a worker that died.
* a loop that has waited ``step_timeout_s`` for its turn: another thread has held the lock that long (a model
  load building an engine or capturing CUDA graphs under it) and is as stuck, and the worker ends the same way.
  Before the heartbeat stopped waiting for the lock, such a worker's registration lapsed; now this is the bound.
"""

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

from kvrelay.shared.worker.model_host import ModelHost

log = logging.getLogger(__name__)

POLL_S = 0.25
STUCK_EXIT_CODE = 3


class StallWatch:
    def __init__(self, host: ModelHost, timeout_s: float, leave: Callable[[], None],
                 end_process: Callable[[int], None] = os._exit) -> None:
        """``timeout_s``: how long a step may run (0: no watch). ``leave``: unregister the worker (before it
        exits). ``end_process``: how the process ends (a test watching in its own process passes another)."""
        self.host = host
        self.timeout_s = timeout_s
        self.leave = leave
        self.end_process = end_process
        self._handled: float | None = None  # when the step whose rank groups were taken down began
        self._ended = False

    def run(self, stop: threading.Event) -> None:
        """The watch's thread, until ``stop``."""
        while self.timeout_s > 0 and not stop.wait(POLL_S):
            self.check()

    def check(self) -> None:
        if self._ended:
            return
        waiting = self.host.lock.wait_since
        waited_turn = 0.0 if waiting is None else time.monotonic() - waiting
        if waited_turn >= self.timeout_s:
            self._end(f"the engine loop has waited {waited_turn:.1f} s (--step-timeout) for its turn, which another "
                      "thread (a model load) holds,")
            return
        since = self.host.lock.turn_since
        if since is None:
            return
        waited = time.monotonic() - since
        if waited < self.timeout_s:
            return
        if since == self._handled:
            if waited >= 2 * self.timeout_s:  # its groups went down, and it still has not returned
                self._end(f"a step has not returned in {waited:.1f} s (--step-timeout)")
            return
        self._handled = since
        # the loop holds the lock and is stuck: nothing changes the slots meanwhile
        down = [slot.instance for slot in list(self.host.slots.values()) if slot.core.abandon_ranks(waited)]
        if not down:
            self._end(f"a step has not returned in {waited:.1f} s (--step-timeout)")
            return
        log.error("a step has not returned in %.1f s (--step-timeout): took the rank groups of %s down; the "
                  "worker exits", waited, ", ".join(down))

    def _end(self, stuck: str) -> None:
        log.error("%s and nothing can interrupt it: the worker leaves the registry and exits (code %d) for its "
                  "supervisor to restart; peers run its requests again", stuck, STUCK_EXIT_CODE)
        self._ended = True
        try:
            self.leave()
        finally:
            for handler in logging.getLogger().handlers:
                handler.flush()
            sys.stderr.flush()
            self.end_process(STUCK_EXIT_CODE)
