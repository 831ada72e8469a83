"""api/sse.py's stream over deltas that say when they are about to wait (as a Generation does): chunks of deltas
that came while more were waiting go out in one write, each delta's chunks go out before the next wait, and the
client reads every chunk in order either way. A real aiohttp server and client on loopback."""

import asyncio
import json

from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer

from kvrelay.gateway.api import sse
from kvrelay.gateway.errors import APIError


class Burst:
    """Deltas 0..n-1: the first ``burst`` were waiting at once, the rest come one at a time, with a wait before
    each as a Generation's queue runs empty."""

    def __init__(self, n: int, burst: int):
        self.n, self.burst = n, burst
        self.before_wait = None

    async def __aiter__(self):
        for i in range(self.n):
            if i >= self.burst and self.before_wait is not None:
                await self.before_wait()
                await asyncio.sleep(0.01)
            yield i


async def serve_and_read(deltas) -> tuple[list[str], int]:
    writes = 0

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal writes
        original, original_eof = web.StreamResponse.write, web.StreamResponse.write_eof

        async def counted(self, data):
            nonlocal writes
            writes += 1
            return await original(self, data)

        async def counted_eof(self, data=b""):
            nonlocal writes
            writes += 1
            return await original_eof(self, data)

        web.StreamResponse.write, web.StreamResponse.write_eof = counted, counted_eof
        try:
            return await sse.stream(request, deltas, head=[{"head": True}], chunks=lambda d: [{"i": d}],
                                    tail=lambda: [{"tail": True}])
        finally:
            web.StreamResponse.write, web.StreamResponse.write_eof = original, original_eof

    app = web.Application()
    app.router.add_get("/", handler)
    async with TestServer(app) as server, ClientSession() as session, session.get(server.make_url("/")) as resp:
        lines = [line.decode().strip() async for line in resp.content if line.strip()]
    return lines, writes


def expected(n: int) -> list[str]:
    return ([f"data: {json.dumps({'head': True}, separators=(',', ':'))}"]
            + [f"data: {json.dumps({'i': i}, separators=(',', ':'))}" for i in range(n)]
            + [f"data: {json.dumps({'tail': True}, separators=(',', ':'))}", "data: [DONE]"])


async def test_deltas_that_waited_together_go_out_in_one_write():
    lines, writes = await serve_and_read(Burst(n=10, burst=6))
    assert lines == expected(10)
    # head, the six waiting deltas in one write, then each of the next three before its wait, and the last one
    # with the tail, [DONE] and the stream's end in the final write
    assert writes == 1 + 1 + 3 + 1


async def test_plain_deltas_go_out_one_write_each():
    async def plain():
        for i in range(5):
            yield i

    lines, writes = await serve_and_read(plain())
    assert lines == expected(5)
    assert writes == 1 + 5 + 1  # head, each delta, then the tail, [DONE] and the end together


async def test_held_chunks_go_out_before_an_error_event():
    class FailsAfterThree(Burst):
        async def __aiter__(self):
            for i in range(3):
                yield i  # all waiting at once: held, no wait between them
            raise APIError(503, "the worker serving this request stopped", code="worker_lost")

    lines, writes = await serve_and_read(FailsAfterThree(n=3, burst=3))
    assert writes == 1 + 1  # the head; then the held deltas, the error, [DONE] and the end in one write
    assert lines[:4] == expected(3)[:4]  # head, then the three held deltas, in order
    assert json.loads(lines[4].removeprefix("data: "))["error"]["code"] == "worker_lost"
    assert lines[5:] == ["data: [DONE]"]  # and no tail: the stream ended in error
