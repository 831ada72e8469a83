"""Whether this process's Redis answers: one state, one log line when it changes.

An outage reaches every thread and task that talks to Redis at once (a worker's heartbeat, abort
listener, gateway watch, control listener and main loop; a gateway's heartbeat, requests, reconciler);
each logging its own failures buried the one fact in tracebacks, many a second. They report here
instead: ``absorb(exc)`` takes an outage error (a refused, broken or timed-out connection, a Redis still
loading its data) quietly, and the first one while Redis was reachable logs ``redis unreachable:
<reason>``. Only the process's prober (a worker's heartbeat, the gateway's Redis watch), which keeps
trying on its own schedule, says it is back (``ok``): ``redis reachable again after N s``. A prober
alone, because a command that began before the recovery may still fail after it, and a second voice
would make the state flap; for the same reason failures in the RECOVERY_GRACE_S after a recovery are
not counted (a Redis that is down again fails every command after that too).

Other errors (a refused command, a wrong type) are no outage: ``absorb`` leaves them to the caller.
The state is read without a round trip (the gateway's ``/health``) and is safe across threads.
"""

import logging
import threading
import time

import redis

OUTAGE_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
# About as long as a command's retries (redis_conn.py): what fails later began after the recovery.
RECOVERY_GRACE_S = 1.0


def is_outage(exc: BaseException) -> bool:
    """Redis did not answer (BusyLoadingError, a Redis loading its data, is a ConnectionError)."""
    return isinstance(exc, OUTAGE_ERRORS)


class RedisHealth:
    def __init__(self, log: logging.Logger):
        self._log = log
        self._lock = threading.Lock()
        self._reachable: bool | None = None  # None: not tried yet
        self._down_since = 0.0  # monotonic
        self._recovered_at = float("-inf")  # monotonic
        self.reason = "not checked yet"

    @property
    def reachable(self) -> bool:
        return self._reachable is True

    @property
    def down_since(self) -> float | None:
        """When (monotonic) the current outage began, as first reported; None while reachable."""
        return self._down_since if self._reachable is False else None

    def down_for(self) -> float:
        """Seconds since it became unreachable; 0 while reachable or not tried yet."""
        return time.monotonic() - self._down_since if self._reachable is False else 0.0

    def absorb(self, exc: BaseException) -> bool:
        """Record ``exc`` if it is an outage (True: the caller says nothing more); False for any other error."""
        if not is_outage(exc):
            return False
        self.failed(exc)
        return True

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            if self._reachable is False or time.monotonic() - self._recovered_at < RECOVERY_GRACE_S:
                return
            self._reachable = False
            self._down_since = time.monotonic()
            self.reason = str(exc) or type(exc).__name__
        self._log.warning("redis unreachable: %s", self.reason)

    def ok(self) -> bool:
        """The prober reached Redis. True when that ends an outage (it was unreachable before)."""
        with self._lock:
            was, since = self._reachable, self._down_since
            self._reachable = True
            self.reason = ""
            if was is False:
                self._recovered_at = time.monotonic()
        if was is False:
            self._log.warning("redis reachable again after %.1f s", time.monotonic() - since)
        return was is False
