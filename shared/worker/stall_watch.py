"""The worker's watch on its engine loop's steps. A step holds the host's lock (step_lock.py), which the
heartbeat needs too, so a step that never returns lets the worker's registration expire: peers then take its
requests while the process lives on and could resume them. Under tensor or pipeline parallelism that is what a
rank that stops answering causes (stopped by a signal, wedged on its device): rank 0 waits in a collective
until the collective's own timeout (shared/engine/parallel/state.py), and no rank died for the group's
watchdog to see. So a step that has waited ``step_timeout_s`` takes the worker's rank groups down: the step
fails with ``TensorParallelError`` and the worker exits, as when a rank dies (its supervisor restarts it, the
gateway and peers run its requests again). Which model's step waits is not known here: every group goes, the
worker is ending anyway. A step of a model without ranks that hangs is only logged: nothing here can end it.
"""

import logging
import threading
import time

from kvrelay.shared.worker.model_host import ModelHost

log = logging.getLogger(__name__)

POLL_S = 0.25


class StallWatch:
    def __init__(self, host: ModelHost, timeout_s: float) -> None:
        """``timeout_s``: how long a step may run (0: no watch)."""
        self.host = host
        self.timeout_s = timeout_s
        self._handled: float | None = None  # when the step already acted on began

    def run(self, stop: threading.Event) -> None:
        """The watch's thread, until ``stop``."""
        while self.timeout_s > 0 and not stop.wait(POLL_S):
            self.check()

    def check(self) -> None:
        since = self.host.lock.turn_since
        if since is None or since == self._handled:
            return
        waited = time.monotonic() - since
        if waited < self.timeout_s:
            return
        self._handled = since
        # the loop holds the lock and is stuck: nothing changes the slots meanwhile
        down = [slot.instance for slot in list(self.host.slots.values()) if slot.core.abandon_ranks(waited)]
        if down:
            log.error("a step has not returned in %.1f s (--step-timeout): took the rank groups of %s down; the "
                      "worker exits", waited, ", ".join(down))
        else:
            log.error("a step has not returned in %.1f s (--step-timeout); no rank group to take down: the "
                      "heartbeat waits for it, and the registration expires", waited)
