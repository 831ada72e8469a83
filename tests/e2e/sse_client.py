"""A small streaming client for load and failure tests: one completion over SSE with httpx (or, for hundreds
of streams at once, aiohttp), reduced to what the tests check (status, tokens, finish reason, error). Every failure is captured, never raised,
so one test can count outcomes across hundreds of requests."""

import json
from dataclasses import dataclass, field

import aiohttp
import httpx


@dataclass
class Outcome:
    status: int = 0  # HTTP status; 0 when no response arrived
    chunks: int = 0  # data events with text
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None  # error event, error body, or transport failure
    code: str | None = None  # the OpenAI error code, when the server sent one
    headers: dict = field(default_factory=dict)
    done: bool = False  # saw data: [DONE]
    completion_tokens: int | None = None  # from the usage chunk (stream_options.include_usage) or body

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.done and self.finish_reason is not None


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict, first_chunk=None,
                            min_chunks: int = 1) -> Outcome:
    """POST ``body`` with stream=true to ``url``; ``first_chunk`` (an asyncio.Event) is set once
    ``min_chunks`` chunks arrived, so a test can act while the stream is known to be in flight."""
    out = Outcome()
    try:
        async with client.stream("POST", url, json={**body, "stream": True}) as resp:
            out.status, out.headers = resp.status_code, dict(resp.headers)
            if resp.status_code != 200:
                _error_body(out, await resp.aread())
                return out
            async for line in resp.aiter_lines():
                _take_line(out, line)
                if first_chunk is not None and out.chunks >= min_chunks:
                    first_chunk.set()
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = out.error or f"{type(exc).__name__}: {exc}"
    return out


def many_streams_session(connections: int, timeout_s: float) -> aiohttp.ClientSession:
    """An aiohttp session for a test that holds hundreds of streams at once: at most ``connections`` open, the
    other requests queued in the client, as a load generator's are. Not httpx there: its connection pool looks
    over every queued request and open connection at each event, so a thousand requests behind a few hundred
    connections cost the test's own process more CPU than the servers spend answering them. ``timeout_s`` bounds
    connecting and each read (a hang), not a request's wait in the queue."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections),
        timeout=aiohttp.ClientTimeout(total=None, connect=None, sock_connect=timeout_s, sock_read=timeout_s))


async def stream_completion_on(session: aiohttp.ClientSession, url: str, body: dict, first_chunk=None,
                               min_chunks: int = 1) -> Outcome:
    """``stream_completion`` on a ``many_streams_session``: the same request, the same Outcome, the same
    ``first_chunk``."""
    out = Outcome()
    try:
        async with session.post(url, json={**body, "stream": True}) as resp:
            out.status, out.headers = resp.status, dict(resp.headers)
            if resp.status != 200:
                _error_body(out, await resp.read())
                return out
            async for raw in resp.content:  # line by line
                _take_line(out, raw.decode().rstrip("\r\n"))
                if first_chunk is not None and out.chunks >= min_chunks:
                    first_chunk.set()
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
        out.error = out.error or f"{type(exc).__name__}: {exc}"
    return out


def _take_line(out: Outcome, line: str) -> None:
    """One line of an SSE body into ``out``."""
    if not line.startswith("data: "):
        return
    data = line[6:]
    if data == "[DONE]":
        out.done = True
        return
    obj = json.loads(data)
    if "error" in obj:
        out.error, out.code = obj["error"].get("message"), obj["error"].get("code")
        return
    if obj.get("usage"):
        out.completion_tokens = obj["usage"]["completion_tokens"]
    for choice in obj.get("choices", []):
        out.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        out.chunks += 1
        out.finish_reason = choice.get("finish_reason") or out.finish_reason


async def post_json(client: httpx.AsyncClient, url: str, body: dict) -> Outcome:
    out = Outcome()
    try:
        resp = await client.post(url, json=body)
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.status, out.headers = resp.status_code, dict(resp.headers)
    if resp.status_code != 200:
        _error_body(out, resp.content)
    else:
        data = resp.json()
        choice = data["choices"][0]
        out.text, out.finish_reason, out.done = choice.get("text", ""), choice["finish_reason"], True
        out.completion_tokens = data["usage"]["completion_tokens"]
    return out


def _error_body(out: Outcome, raw: bytes) -> None:
    try:
        err = json.loads(raw)["error"]
        out.error, out.code = err.get("message") or "error", err.get("code")
    except (ValueError, KeyError, TypeError):
        out.error = raw[:200].decode(errors="replace") or f"HTTP {out.status}"
