"""Keeps ``kvrelay serve``'s children running, as systemd's ``Restart=on-failure`` with a start limit does.

A child's life (gateways and workers alike):

    starting ──says "ready"──▶ running ──exits──▶ down ──backoff──▶ starting (same config, a new process)
        │                                           │
        │                                           └── its ``max_crashes``-th exit within ``crash_window``
        │                                               seconds ──▶ give up
        └── exits before it was ever ready ──▶ StartupError: "<name>: <the cause it reported>"

A child says it is ready, or why it could not start, over a pipe of its own (shared/wire/startup_report.py).
One that never got as far as ready is not restarted: a port in use or a setting the model refuses fails the
same way every time, and a restart loop would only bury the cause. Once a child was ready, its later
starts are restarts like any other (a restarted worker may briefly fail while Redis is down).

The backoff starts at BACKOFF_START_S (or the child's own ``backoff_start``) and doubles up to BACKOFF_MAX_S
while the child keeps crashing; one that ran HEALTHY_S before its crash starts again at its first backoff.
Any exit counts as a crash: only serve's own Ctrl-C/SIGTERM ends a child for good, and that stops
supervision first. Giving up is serve's to act on (it stops everything and exits non-zero with the
reason ``check`` returns).

A restarted worker generates a new worker id, so nobody mistakes it for its predecessor: requests the
dead one held end at the gateway (503), and jobs it never ACKed are reclaimed from Redis by its successor.
"""

import logging
import os
import subprocess
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvrelay.shared.wire.startup_report import FATAL, READY, STATUS_FD_ENV
from kvrelay.startup_checks import StartupError

log = logging.getLogger(__name__)

BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
HEALTHY_S = 60.0  # a crash after running this long is not part of a crash loop: the backoff starts over


@dataclass
class _Child:
    name: str
    start: Callable[[int], subprocess.Popen]
    proc: subprocess.Popen | None = None
    status_fd: int | None = None  # the read end of the current process's status pipe
    said: bytes = b""  # what it wrote there so far
    ever_ready: bool = False
    started_at: float = 0.0
    backoff_start_s: float = BACKOFF_START_S
    backoff_s: float = BACKOFF_START_S
    restart_at: float | None = None  # set while it is down
    crashes: deque[float] = field(default_factory=deque)  # monotonic times, within the window


class Supervisor:
    def __init__(self, starts: dict[str, Callable[[int], subprocess.Popen]], max_crashes: int, crash_window: float,
                 on_exit: Callable[[str, subprocess.Popen], None] = lambda name, proc: None,
                 backoff_start: Mapping[str, float] | None = None):
        """``starts``: each child's name and how to start it, given the write end of its status pipe (to pass
        on: ``status_env`` and ``pass_fds``), in the order they start; ``on_exit`` runs once per exit
        noticed, before anything is restarted (serve clears a killed worker's registration there);
        ``backoff_start``: a child's first backoff, if not BACKOFF_START_S (serve's Redis, which every
        other child waits on and which is back from its file in milliseconds)."""
        self.max_crashes, self.crash_window, self.on_exit = max_crashes, crash_window, on_exit
        firsts = backoff_start or {}
        self._children = [_Child(name, start, backoff_start_s=firsts.get(name, BACKOFF_START_S),
                                 backoff_s=firsts.get(name, BACKOFF_START_S)) for name, start in starts.items()]
        self.procs: dict[str, subprocess.Popen] = {}  # the latest process of each child, live or not

    @staticmethod
    def status_env(write_fd: int) -> dict[str, str]:
        """The variables that tell a child where its status pipe is."""
        return {STATUS_FD_ENV: str(write_fd)}

    def start_all(self) -> None:
        for child in self._children:
            self._start(child)

    def check(self) -> str | None:
        """Notice exits and restart the children whose backoff is over; the reason to give up, or None.
        Raises StartupError when a child exits before it was ever ready."""
        now = time.monotonic()
        for child in self._children:
            if child.restart_at is None:
                self._read_status(child)
                code = child.proc.poll()
                if code is not None and (reason := self._crashed(child, code, now)):
                    return reason
            elif now >= child.restart_at:
                self._start(child)
        return None

    def ready(self, name: str) -> bool:
        """Whether ``name``'s current process said it is ready, and runs."""
        child = next(c for c in self._children if c.name == name)
        return child.restart_at is None and READY.encode() in child.said.splitlines() and child.proc.poll() is None

    def _start(self, child: _Child) -> None:
        again = child.proc is not None
        self._close_status(child)
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        try:
            child.proc = self.procs[child.name] = child.start(write_fd)
        finally:
            os.close(write_fd)  # the child holds its own copy: at its exit, reads see the end
        child.status_fd, child.said = read_fd, b""
        child.started_at, child.restart_at = time.monotonic(), None
        if again:
            log.info("%s started again (pid %d)", child.name, child.proc.pid)

    def _read_status(self, child: _Child) -> None:
        while child.status_fd is not None:
            try:
                chunk = os.read(child.status_fd, 4096)
            except BlockingIOError:
                return
            if not chunk:  # every writer closed: the child exited (or closed it)
                self._close_status(child)
                return
            child.said += chunk
            if READY.encode() in child.said.splitlines() and not child.ever_ready:
                child.ever_ready = True
                log.debug("%s is ready", child.name)

    def _close_status(self, child: _Child) -> None:
        if child.status_fd is not None:
            os.close(child.status_fd)
            child.status_fd = None

    def _never_ready(self, child: _Child, code: int) -> StartupError:
        fatal = [line.decode(errors="replace")[len(FATAL):] for line in child.said.splitlines()
                 if line.startswith(FATAL.encode())]
        cause = fatal[-1] if fatal else f"exited with code {code} before it was ready"
        return StartupError(f"{child.name}: {cause}")

    def _crashed(self, child: _Child, code: int, now: float) -> str | None:
        self._read_status(child)  # what it wrote just before it exited
        self.on_exit(child.name, child.proc)
        if not child.ever_ready:
            raise self._never_ready(child, code)
        child.crashes.append(now)
        while now - child.crashes[0] > self.crash_window:
            child.crashes.popleft()
        crashes = len(child.crashes)
        if crashes >= self.max_crashes:
            return (f"{child.name} exited with code {code}, {crashes} time{'s' * (crashes > 1)} within "
                    f"{self.crash_window:g}s (--max-crashes {self.max_crashes}); stopping everything")
        if now - child.started_at >= HEALTHY_S:
            child.backoff_s = child.backoff_start_s
        log.warning("%s exited with code %s; restarting it in %gs (crash %d of %d within %gs)", child.name, code,
                    child.backoff_s, crashes, self.max_crashes, self.crash_window)
        child.restart_at = now + child.backoff_s
        child.backoff_s = min(child.backoff_s * 2, BACKOFF_MAX_S)
        return None
