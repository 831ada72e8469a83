"""Keeps ``kvrelay serve``'s children running, as systemd's ``Restart=on-failure`` with a start limit does.

A child's life (gateways and workers alike):

    running ──exits──▶ down ──backoff──▶ running (started again: same config, a new process)
                        │
                        └── its ``max_crashes``-th exit within ``crash_window`` seconds ──▶ give up

The backoff starts at BACKOFF_START_S and doubles up to BACKOFF_MAX_S while the child keeps crashing; one
that ran HEALTHY_S before its crash starts again at BACKOFF_START_S. Any exit counts as a crash: only
serve's own Ctrl-C/SIGTERM ends a child for good, and that stops supervision first. Giving up is serve's
to act on (it stops everything and exits non-zero with the reason ``check`` returns).

A restarted worker generates a new worker id, so nobody mistakes it for its predecessor: requests the
dead one held end at the gateway (503), and jobs it never ACKed are reclaimed from Redis by its successor.
"""

import logging
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
HEALTHY_S = 60.0  # a crash after running this long is not part of a crash loop: the backoff starts over


@dataclass
class _Child:
    name: str
    start: Callable[[], subprocess.Popen]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    backoff_s: float = BACKOFF_START_S
    restart_at: float | None = None  # set while it is down
    crashes: deque[float] = field(default_factory=deque)  # monotonic times, within the window


class Supervisor:
    def __init__(self, starts: dict[str, Callable[[], subprocess.Popen]], max_crashes: int, crash_window: float,
                 on_exit: Callable[[str, subprocess.Popen], None] = lambda name, proc: None):
        """``starts``: each child's name and how to start it; ``on_exit`` runs once per exit noticed, before
        anything is restarted (serve clears a killed worker's registration there)."""
        self.max_crashes, self.crash_window, self.on_exit = max_crashes, crash_window, on_exit
        self._children = [_Child(name, start) for name, start in starts.items()]
        self.procs: dict[str, subprocess.Popen] = {}  # the latest process of each child, live or not

    def start_all(self) -> None:
        for child in self._children:
            self._start(child)

    def check(self) -> str | None:
        """Notice exits and restart the children whose backoff is over; the reason to give up, or None."""
        now = time.monotonic()
        for child in self._children:
            if child.restart_at is None:
                code = child.proc.poll()
                if code is not None and (reason := self._crashed(child, code, now)):
                    return reason
            elif now >= child.restart_at:
                self._start(child)
        return None

    def _start(self, child: _Child) -> None:
        again = child.proc is not None
        child.proc = self.procs[child.name] = child.start()
        child.started_at, child.restart_at = time.monotonic(), None
        if again:
            log.info("%s started again (pid %d)", child.name, child.proc.pid)

    def _crashed(self, child: _Child, code: int, now: float) -> str | None:
        self.on_exit(child.name, child.proc)
        child.crashes.append(now)
        while now - child.crashes[0] > self.crash_window:
            child.crashes.popleft()
        crashes = len(child.crashes)
        if crashes >= self.max_crashes:
            return (f"{child.name} exited with code {code}, {crashes} time{'s' * (crashes > 1)} within "
                    f"{self.crash_window:g}s (--max-crashes {self.max_crashes}); stopping everything")
        if now - child.started_at >= HEALTHY_S:
            child.backoff_s = BACKOFF_START_S
        log.warning("%s exited with code %s; restarting it in %gs (crash %d of %d within %gs)", child.name, code,
                    child.backoff_s, crashes, self.max_crashes, self.crash_window)
        child.restart_at = now + child.backoff_s
        child.backoff_s = min(child.backoff_s * 2, BACKOFF_MAX_S)
        return None
