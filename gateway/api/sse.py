"""Server-sent events the way OpenAI streams them: ``data: {json}\\n\\n`` per chunk, ``data: [DONE]`` last,
and a failure mid-stream as ``data: {"error": {...}}`` (the SDKs raise on it) followed by ``[DONE]``."""

import json
from collections.abc import AsyncIterable, Callable, Iterable

from aiohttp import web

from kvrelay.gateway.errors import APIError, ClientGone
from kvrelay.gateway.metrics import STREAM_COMPLETE

HELD_MAX_BYTES = 64 * 1024  # a stream far behind still writes in pieces of this much


def dumps(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


async def open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream; charset=utf-8",
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",  # nginx must pass chunks through, not buffer the stream
    })
    await response.prepare(request)
    return response


async def send(response: web.StreamResponse, obj: object) -> None:
    await response.write(event(obj))


def event(obj: object) -> bytes:
    return f"data: {dumps(obj)}\n\n".encode()


DONE = b"data: [DONE]\n\n"


async def stream(request: web.Request, deltas: AsyncIterable, head: Iterable[dict],
                 chunks: Callable[[object], Iterable[dict]], tail: Callable[[], Iterable[dict]]) -> web.StreamResponse:
    """Write ``head``, then ``chunks(delta)`` per delta, then ``tail()``; an APIError raised by the
    deltas becomes an error event. A client that went away just ends the stream (the caller aborts).

    Deltas that say when they are about to wait (a ``before_wait`` hook, api/generation.py) have their chunks
    held while more events wait and written together before the wait: a gateway that keeps up writes each
    delta as it comes, one that fell behind catches up with one write per request instead of one per token (a
    write is a system call, the largest cost of a streamed token). What is left once the deltas end (the last
    held chunks, the tail, an error event, ``[DONE]``) goes out in one write with the stream's end."""
    response = await open_stream(request)
    held = bytearray()

    async def write_held() -> None:
        if held:
            data = bytes(held)
            held.clear()
            await response.write(data)

    holds = hasattr(deltas, "before_wait")
    if holds:
        deltas.before_wait = write_held
    try:
        try:
            for obj in head:
                await send(response, obj)
            async for delta in deltas:
                for obj in chunks(delta):
                    held += event(obj)
                if not holds or len(held) >= HELD_MAX_BYTES:
                    await write_held()
            for obj in tail():
                held += event(obj)
        except APIError as exc:
            held += event(exc.body())  # after what the client was owed before the error
        await response.write_eof(bytes(held + DONE))
        request[STREAM_COMPLETE] = response.status
    except (ClientGone, ConnectionResetError):
        pass
    return response
