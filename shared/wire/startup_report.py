"""How a child of ``kvrelay serve`` tells its supervisor it started, or why it could not.

serve hands each child the write end of a pipe (its number in ``$KVRELAY_STATUS_FD``). The child writes
one line: ``ready`` once it serves (the gateway bound its port, a worker registered with its models
loaded), or ``fatal <cause>`` when start-up failed for a reason of the operator's (a port in use, a
setting the model refuses, too little memory). The supervisor restarts only children that once became
ready: one that fails before that would fail the same way again, so serve stops and says the cause.

Outside serve there is no pipe: the cause goes to stderr as one line instead of a traceback.
"""

import logging
import os
import sys

STATUS_FD_ENV = "KVRELAY_STATUS_FD"
READY = "ready"
FATAL = "fatal "

log = logging.getLogger(__name__)
_ready = False


def report_ready() -> None:
    """Say once that this process serves; a no-op outside serve and after the first call."""
    global _ready
    if not _ready:
        _ready = True
        _write(READY)


def is_ready() -> bool:
    return _ready


def expected_cause(exc: BaseException) -> bool:
    """Start-up failures an operator causes and can fix from the message alone: a setting refused
    (ValueError, the config's ConfigError among them), the OS refusing a port or a file (OSError),
    memory (MemoryError, torch's OutOfMemoryError), Redis unreachable or refusing the password.
    Anything else is a bug and keeps its traceback."""
    if isinstance(exc, (ValueError, OSError, MemoryError)) or type(exc).__name__ == "OutOfMemoryError":
        return True
    redis = sys.modules.get("redis")  # imported by whoever could raise its errors
    return redis is not None and isinstance(exc, (redis.ConnectionError, redis.AuthenticationError,
                                                  redis.ResponseError))


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def report_fatal(command: str, exc: BaseException) -> None:
    """The cause, as one line: to serve over the pipe, else on stderr. The traceback only at debug level."""
    log.debug("start-up failed", exc_info=exc)
    if not _write(FATAL + one_line(exc)):
        print(f"kvrelay {command}: error: {one_line(exc)}", file=sys.stderr, flush=True)


def _write(line: str) -> bool:
    fd = os.environ.get(STATUS_FD_ENV)
    if not fd:
        return False
    try:
        os.write(int(fd), (line + "\n").encode())
        return True
    except (OSError, ValueError):  # serve is gone or the number is not ours: nobody to tell
        return False
