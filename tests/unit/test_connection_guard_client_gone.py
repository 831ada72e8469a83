"""A client that gives up before its answer is written (a readiness probe's short timeout on a loaded box)
is an ordinary event: the connection guard, which writes a handler's response itself, lets it pass as
aiohttp's own write does, with no error and no traceback logged. Real sockets, the real guard and site."""

import asyncio
import logging

from aiohttp import web

from kvrelay.gateway.connection_guard import ConnectionGuard, GuardedSite

BOUND_S = 60.0  # a hang bound, not a speed claim


def test_a_response_to_a_client_that_left_is_dropped_quietly(caplog):
    caplog.set_level(logging.INFO)

    async def run() -> list[str]:
        handled = asyncio.Event()
        outcome: list[str] = []

        @web.middleware
        async def outside(request, handler):  # sees what the guard (the gateway's outermost) hands aiohttp
            try:
                response = await handler(request)
                outcome.append("returned")
                return response
            except Exception as exc:
                outcome.append(type(exc).__name__)
                raise
            finally:
                handled.set()

        async def slow(request: web.Request) -> web.Response:
            while request.transport is not None and not request.transport.is_closing():
                await asyncio.sleep(0.01)  # until the client has gone
            return web.Response(text="too late")

        guard = ConnectionGuard(header_timeout=BOUND_S, max_idle=10)
        app = web.Application(middlewares=[outside, guard.middleware])
        app.router.add_get("/slow", slow)
        runner = web.AppRunner(app)
        await runner.setup()
        site = GuardedSite(runner, guard, "127.0.0.1", 0, backlog=8)
        await site.start()
        port = site.port
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /slow HTTP/1.1\r\nHost: gateway\r\n\r\n")
            await writer.drain()
            writer.close()  # gives up before the answer
            await writer.wait_closed()
            await asyncio.wait_for(handled.wait(), BOUND_S)
            return outcome
        finally:
            await runner.cleanup()

    assert asyncio.run(run()) == ["returned"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
