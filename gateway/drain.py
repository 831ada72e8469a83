"""Graceful shutdown of a gateway, and the server loop that runs it.

On SIGTERM (or SIGINT) the gateway keeps its listener open but:
  1. ``/ready`` answers 503 at once, so Kubernetes and load balancers stop sending it traffic;
  2. every new API request gets 503 + Retry-After + ``Connection: close`` (a client or nginx retries it
     elsewhere, and a kept-alive upstream connection is not reused for the next request);
  3. requests already in flight run to completion, for up to ``drain_timeout`` seconds;
  4. past that, what is still running ends cleanly: a stream gets an error event and ``[DONE]``, a
     plain request a 503, and its jobs are aborted so workers free their KV (``Generation``);
  5. the server closes and the process exits.

The listener stays open during the drain on purpose: between SIGTERM and the moment every load balancer
has noticed, a refused connection would be an error the client cannot tell from a dead server, while a
503 with Retry-After is an answer every OpenAI client retries.
"""

import asyncio
import logging
import signal
import time

from aiohttp import web

from kvrelay.gateway.connection_guard import CONNECTION_GUARD, GuardedSite
from kvrelay.gateway.errors import APIError
from kvrelay.gateway.state import CONFIG
from kvrelay.shared.wire.startup_report import report_ready

log = logging.getLogger("kvrelay.gateway")

# Probes and metrics keep answering while draining: liveness must stay green (a draining gateway is
# healthy) and /ready is what reports the drain.
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})
# After the drain deadline, how long the last requests get to write their error event (they notice
# the deadline within GatewayConfig.disconnect_poll_s).
_FINISH_GRACE_S = 2.0


class Drain:
    """The gateway's drain state and its count of requests in flight."""

    def __init__(self) -> None:
        self.draining = False
        self.expired = False  # the drain deadline passed: in-flight requests must end now
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def begin(self) -> None:
        self.draining = True

    def expire(self) -> None:
        self.expired = True

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False


DRAIN = web.AppKey("drain", Drain)


def draining_error(retry_after: int) -> APIError:
    return APIError(503, "this gateway is shutting down; retry the request", code="shutting_down",
                    headers={"Retry-After": str(retry_after)})


def make_drain_middleware(retry_after: int):
    @web.middleware
    async def drain_middleware(request: web.Request, handler) -> web.StreamResponse:
        drain = request.app[DRAIN]
        if request.path in PROBE_PATHS:
            return await handler(request)
        if drain.draining:
            response = draining_error(retry_after).response()
            response.force_close()  # nginx must not send its next request down this connection
            return response
        drain.enter()
        try:
            return await handler(request)
        finally:
            drain.leave()

    return drain_middleware


def access_log(config) -> dict:
    """The runner's access-log argument: none with --disable-uvicorn-access-log, aiohttp's logger otherwise."""
    return {"access_log": None} if config.disable_uvicorn_access_log else {}


async def serve(app: web.Application, host: str, port: int, drain_timeout: float, reuse_port: bool = False) -> None:
    """Serve ``app`` until SIGTERM/SIGINT, then drain it as described above."""
    # handler_cancellation: a client that disconnects cancels its handler at once, which aborts its jobs.
    # shutdown_timeout is short because the drain already waited for handlers.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=_FINISH_GRACE_S,
                           keepalive_timeout=app[CONFIG].timeout_keep_alive, **access_log(app[CONFIG]))
    await runner.setup()
    # a deep backlog: behind nginx a burst of new upstream connections must queue, not be refused
    # reuse_port: the kernel spreads new connections over every gateway process bound to the port
    site = GuardedSite(runner, app[CONNECTION_GUARD], host, port, backlog=2048, reuse_port=reuse_port)
    await site.start()
    log.info("gateway listening on http://%s:%d", host, site.port)
    report_ready()  # to kvrelay serve: this process holds the port, so the /ready it polls is ours
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        drain = app[DRAIN]
        drain.begin()
        started = time.monotonic()
        log.info("draining: %d request(s) in flight, up to %gs", drain.in_flight, drain_timeout)
        if not await drain.wait_idle(drain_timeout):
            log.warning("drain timeout: ending %d request(s) still in flight", drain.in_flight)
            drain.expire()
            await drain.wait_idle(_FINISH_GRACE_S + 1.0)
        log.info("drained in %.1fs; stopping", time.monotonic() - started)
    finally:
        await runner.cleanup()
