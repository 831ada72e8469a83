"""--disable-uvicorn-access-log (vLLM's flag): the runner gateway/drain.py builds writes no access line per request
with it, and aiohttp's usual line without it."""

import logging

import aiohttp
import pytest
from aiohttp import web

from kvrelay.gateway.drain import access_log
from kvrelay.shared.config.gateway import GatewayConfig


async def _pong(request: web.Request) -> web.Response:
    return web.Response(text="pong")


async def _one_request(config: GatewayConfig) -> None:
    app = web.Application()
    app.router.add_get("/ping", _pong)
    runner = web.AppRunner(app, **access_log(config))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/ping") as r:
            assert await r.text() == "pong"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("disabled", [False, True])
async def test_the_access_log_follows_the_flag(caplog, disabled):
    with caplog.at_level(logging.INFO, logger="aiohttp.access"):
        await _one_request(GatewayConfig(disable_uvicorn_access_log=disabled))
    lines = [r for r in caplog.records if r.name == "aiohttp.access"]
    assert (lines == []) == disabled
    assert disabled or "GET /ping" in lines[0].getMessage()
