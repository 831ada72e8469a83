"""Slow and idle connections: a header read timeout and a cap on idle connections, which aiohttp lacks.

aiohttp closes a connection only after ``keepalive_timeout`` without a request, and partial headers do
not count as one: a client sending a few header bytes and then nothing held its socket (190 of them
held for 30 s), and a thousand of them exhaust the process's file descriptors. Here each connection's
protocol is wrapped (``GuardedConnection`` forwards every call to aiohttp's own ``RequestHandler``):

* a request's headers must be complete within ``--timeout-header-read`` seconds, counted from the
  connection (its first request) or from the first byte after a response (later ones); a connection
  idle between requests is not timed here but by ``--timeout-keep-alive`` (aiohttp's);
* at most ``--limit-idle-connections`` connections are idle (no request being handled: waiting for the
  first byte or for the rest of the headers); past that the longest idle ones are closed.

"Headers complete" and "response sent" are seen from the app: ``middleware`` (outermost) marks the
connection busy when its handler starts, which aiohttp does once a request's headers are parsed, and
idle again after the response is written (it writes it itself, so an idle connection never has a
response on its way). A connection that did not come through ``GuardedSite`` is left alone.
"""

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from aiohttp import web

log = logging.getLogger("kvrelay.gateway")


class ConnectionGuard:
    def __init__(self, header_timeout: float, max_idle: int,
                 on_close: Callable[[str], None] = lambda reason: None):
        """``on_close(reason)`` counts each closed connection: "header_timeout" or "idle_limit"."""
        self.header_timeout = header_timeout
        self.max_idle = max_idle
        self.on_close = on_close
        self.connections: dict[asyncio.BaseTransport, GuardedConnection] = {}
        self._idle: dict[GuardedConnection, None] = {}  # insertion order: the longest idle first

    def factory(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: GuardedConnection(make(), self)

    def idle(self, conn: "GuardedConnection") -> None:
        self._idle.pop(conn, None)
        self._idle[conn] = None
        while len(self._idle) > self.max_idle:
            oldest = next(iter(self._idle))
            self._idle.pop(oldest)
            oldest.close("idle_limit")

    def busy(self, conn: "GuardedConnection") -> None:
        self._idle.pop(conn, None)

    def forget(self, conn: "GuardedConnection") -> None:
        self._idle.pop(conn, None)
        self.connections.pop(conn.transport, None)

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        conn = self.connections.get(request.transport) if request.transport is not None else None
        if conn is None:
            return await handler(request)
        conn.request_started()
        try:
            response = await handler(request)
            if not response.prepared:  # written here, so the connection is busy until it is sent
                try:
                    await response.prepare(request)
                    await response.write_eof()
                except ConnectionError:  # the client left first: as aiohttp's own write, nothing to log
                    pass
            return response
        finally:
            conn.request_finished()


class GuardedConnection(asyncio.Protocol):
    """aiohttp's protocol for one connection, with the header timer and idle bookkeeping around it."""

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard):
        self.inner, self.guard = inner, guard
        self.transport: asyncio.BaseTransport | None = None
        self.busy = False
        self.unread = False  # bytes arrived while a request was handled: the next request has begun
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.guard.connections[transport] = self
        self.inner.connection_made(transport)
        self._start_timer()
        self.guard.idle(self)

    def data_received(self, data: bytes) -> None:
        if self.busy:
            self.unread = True
        elif self._timer is None:
            self._start_timer()
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        self.guard.forget(self)
        self.inner.connection_lost(exc)

    def request_started(self) -> None:
        self.busy, self.unread = True, False
        self._stop_timer()
        self.guard.busy(self)

    def request_finished(self) -> None:
        self.busy = False
        if self.transport is None or self.transport.is_closing():
            return
        if self.unread:  # a pipelined or early next request: its headers are on the clock already
            self._start_timer()
        self.guard.idle(self)

    def close(self, reason: str) -> None:
        self._stop_timer()
        if self.transport is not None and not self.transport.is_closing():
            log.debug("closing connection from %s: %s", self.transport.get_extra_info("peername"), reason)
            self.guard.on_close(reason)
            self.transport.close()

    def _start_timer(self) -> None:
        self._stop_timer()
        self._timer = asyncio.get_running_loop().call_later(self.guard.header_timeout, self._headers_late)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _headers_late(self) -> None:
        self._timer = None
        if not self.busy:
            self.close("header_timeout")


class GuardedSite(web.SockSite):
    """A TCP site whose connections go through ``guard`` (aiohttp's TCPSite, with the protocol wrapped)."""

    def __init__(self, runner: web.BaseRunner, guard: ConnectionGuard, host: str, port: int, *, backlog: int,
                 reuse_port: bool = False):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, backlog=backlog, reuse_port=reuse_port)
        super().__init__(runner, sock, backlog=backlog)
        self.guard = guard

    @property
    def port(self) -> int:
        """The port bound: the one asked for, or the kernel's pick for port 0."""
        return self._sock.getsockname()[1]

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers with the runner, which stops it at cleanup
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self.guard.factory(server), sock=self._sock, backlog=self._backlog)


CONNECTION_GUARD = web.AppKey("connection_guard", ConnectionGuard)
