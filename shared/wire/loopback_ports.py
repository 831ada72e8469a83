"""Loopback ports for servers a launcher starts (``kvrelay serve``'s children, the local clusters of
benchmarks and tests), picked where the kernel never hands ports out.

A port found free by binding port 0 and closing the socket stays free only until someone else binds it,
and the kernel hands the same ephemeral range to every bind(0) and every connect() on the host. A child
that takes seconds of imports before it binds can find its port taken, and worse, a probe of that port
then reaches the other server. Below the ephemeral range (``ip_local_port_range``) no bind(0) or
connect() ever lands, so a port here is taken only by another launcher: each process walks its own
stretch from a random start, one block of ports after the next, and skips a block where it finds one bound.

Two launchers can still come to one block before either child binds it (a test hands a port to `kvrelay
serve`, whose own walk then reaches that block while the child still imports). So a block is also claimed in a
folder every process on the host shares: a file per block and RESERVE_S window, created exclusively, which
another process's walk skips. Where that folder cannot be written, the bind checks alone decide, as before.
"""

import contextlib
import os
import random
import socket
import threading
import time
from pathlib import Path

LOWEST = 15000  # above the ports services are commonly configured on (8000s, 9000s)
# ports handed out together: a caller may number ports up from the one it got (kvrelay serve gives its i-th
# worker --worker-monitoring-port + i, its i-th gateway --zmq-port + i)
BLOCK = 8
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
RESERVE_S = 300  # a claim lasts this window and the next: ample for a child's imports before it binds
# a fixed folder, not $TMPDIR: processes of one host with other TMPDIRs (a test's, a benchmark's) must see one
# another's claims, and a run that must leave its TMPDIR empty finds nothing of ours there
_CLAIMS = Path("/tmp") / f"kvrelay-loopback-ports-{os.getuid()}"
_lock = threading.Lock()
_next: int | None = None


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(also_free_at: int = 0) -> int:
    """A loopback port outside the ephemeral range with nothing bound to it or to the BLOCK - 1 ports after
    it, which no later call hands out; with ``also_free_at`` N, port + N is free and outside the range too (a
    Redis cluster node's bus listens at port + 10000)."""
    global _next
    top = ephemeral_start() - also_free_at - BLOCK
    if top - LOWEST < 1000:  # an ephemeral range reaching low: only bind(0) is left (the old race with it)
        return _ephemeral(also_free_at)
    blocks = (top - LOWEST) // BLOCK
    with _lock:
        if _next is None:
            _next = random.randrange(blocks)
        for _ in range(blocks):
            port = LOWEST + (_next % blocks) * BLOCK  # one cursor for every span: a pair's is shorter
            _next = (_next + 1) % blocks
            if all(map(_bindable, range(port, port + BLOCK))) and (
                    not also_free_at or _bindable(port + also_free_at)) and _claim(port):
                return port
    raise RuntimeError(f"no free loopback port in {LOWEST}-{top}")


def _claim(port: int) -> bool:
    """Whether this process may hand out ``port``'s block: no other process claimed it in this window or the
    one before; claims it for this window."""
    window = int(time.time() // RESERVE_S)
    try:
        _CLAIMS.mkdir(exist_ok=True)
        if _claimed_by_another(_CLAIMS / f"{port}.{window - 1}"):
            return False
        fd = os.open(_CLAIMS / f"{port}.{window}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return not _claimed_by_another(_CLAIMS / f"{port}.{window}")
    except OSError:  # a folder this user cannot write: the bind checks alone
        return True
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    _forget_old(window)
    return True


def _claimed_by_another(path: Path) -> bool:
    try:
        return path.read_text() != str(os.getpid())
    except OSError:
        return False


_swept = False


def _forget_old(window: int) -> None:
    """Once per process: remove the claims of windows that no longer count."""
    global _swept
    if _swept:
        return
    _swept = True
    for path in _CLAIMS.iterdir():
        with contextlib.suppress(ValueError, OSError):
            if int(path.suffix[1:]) < window - 1:
                path.unlink()


def _ephemeral(also_free_at: int) -> int:
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not also_free_at or (port + also_free_at < 65536 and _bindable(port + also_free_at)):
            return port
    raise RuntimeError("no free loopback port")
