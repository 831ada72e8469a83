"""A client that hangs up before its request is queued gets nothing queued: no job reaches a worker.

A busy gateway loop reads a hang-up (the transport is closing from then on) a callback round before aiohttp
cancels the handler, and the handler may wake up in between: it would queue jobs for nobody, aborted only
later. This test makes that order happen on a real gateway, real Redis and a real socket. A first request
shows where a request waits inside ``Generation._submit`` before its XADD; for the second, the gateway's loop
is held (as a loaded loop is) at the last of those places while its client sends FIN: either while the
request still waits there (the loop then reads the hang-up in the same round as the Redis reply that wakes
the handler) or once the reply was read and the handler's wake-up is queued (the loop runs the handler
before it reads the hang-up at all, so only the socket itself can tell).
"""

import asyncio
import json
import socket
import threading
import time
from collections.abc import Coroutine

import pytest
import redis
import requests

from kvrelay.gateway.api.generation import Generation
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.redis_conn import sync_client
from tests.integration.gateway_harness import MODEL, Stack, running_stack
from tests.integration.tenant_harness import sample, scrape

pytestmark = pytest.mark.timeout(120)

BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 4}
ROUTE = "/v1/completions"
# where a task waits: each coroutine it awaits from Generation._submit inward, by name and line (a bare
# future by its type's name)
Wait = tuple[tuple[str, int], ...]


def _wait_in_submit(task: asyncio.Task) -> Wait | None:
    coro, chain = task.get_coro(), None
    while coro is not None:
        code = getattr(coro, "cr_code", None)
        if code is Generation._submit.__code__:
            chain = []
        if chain is not None:
            frame = getattr(coro, "cr_frame", None)
            chain.append((code.co_name if code else type(coro).__name__, frame.f_lineno if frame else 0))
        coro = getattr(coro, "cr_await", None)
    return tuple(chain) if chain is not None else None


async def _waits_in_submit(started: threading.Event) -> list[Wait]:
    """On the gateway's loop, once a callback round (so no wait goes unseen): every place one request waits
    inside ``_submit``, in order, until it leaves."""
    seen: list[Wait] = []
    started.set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        waits = [w for w in map(_wait_in_submit, asyncio.all_tasks()) if w is not None]
        if waits and (not seen or waits[0] != seen[-1]):
            seen.append(waits[0])
        if seen and not waits:
            return seen
        await asyncio.sleep(0)
    raise AssertionError("no request went through _submit")


def _woken(task: asyncio.Task) -> bool:
    """Whether the future the task waits on is done: its wake-up is queued (asyncio keeps that future in
    ``_fut_waiter``; the coroutine chain ends in an iterator that does not show it)."""
    waiter = task._fut_waiter
    return waiter is not None and waiter.done()


async def _hold_loop_at(line: tuple[str, int], woken: bool, started: threading.Event,
                        may_hang_up: threading.Event, hung_up: threading.Event) -> None:
    """On the gateway's loop: once a request waits at ``line`` of ``_submit`` (however deep inside redis-py,
    whose chain of awaits differs between requests), and its wake-up is queued if ``woken``, block the loop
    until its client hung up."""
    started.set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if any((w := _wait_in_submit(t)) is not None and w[0] == line and (_woken(t) or not woken)
               for t in asyncio.all_tasks()):
            may_hang_up.set()
            hung_up.wait(10)
            time.sleep(0.3)  # the FIN arrives before the loop looks at its sockets again
            return
        await asyncio.sleep(0)
    raise AssertionError("no request waited there")


def _on_gateway_loop(stack: Stack, make: Coroutine, started: threading.Event) -> asyncio.Future:
    future = asyncio.run_coroutine_threadsafe(make, stack.server.loop)
    assert started.wait(30)
    return future


def _last_ids(r: redis.Redis, streams: list[str]) -> dict[str, str | None]:
    out = {}
    for stream in streams:
        try:
            out[stream] = r.xinfo_stream(stream)["last-generated-id"]
        except redis.ResponseError:  # no such stream
            out[stream] = None
    return out


def _client_aborts(samples: dict) -> float:
    return sample(samples, "kvrelay_http_requests_total", route=ROUTE, status="499")


@pytest.mark.parametrize("woken", [False, True], ids=["hang-up read with the reply", "handler woken first"])
def test_a_client_gone_before_its_job_is_queued_gets_no_job_queued(tmp_path, woken):
    # the worker list cached: the queue-length lookup is then the request's one Redis round trip in _submit
    with running_stack(tmp_path, registry_cache_s=60.0) as stack:
        assert requests.post(f"{stack.url}{ROUTE}", json=BODY).status_code == 200  # connections and caches warm
        started = threading.Event()
        watch = _on_gateway_loop(stack, _waits_in_submit(started), started)
        assert requests.post(f"{stack.url}{ROUTE}", json=BODY).status_code == 200
        seen = watch.result(30)
        xadd_line = seen[-1][0][1]  # _submit's line while its XADD is in flight
        last_line = [w[0] for w in seen if w[0][1] != xadd_line][-1]  # the queue-length round trip

        r = sync_client(stack.redis_url)
        streams = [keys.prefill_stream(MODEL), keys.prefill_worker_stream(MODEL, stack.worker.worker_id)]
        ids, jobs, before = _last_ids(r, streams), len(stack.worker.jobs), scrape(stack.url)
        started, may_hang_up, hung_up = threading.Event(), threading.Event(), threading.Event()
        held = _on_gateway_loop(stack, _hold_loop_at(last_line, woken, started, may_hang_up, hung_up), started)
        body = json.dumps(BODY).encode()
        with socket.create_connection(("127.0.0.1", stack.server.config.port)) as sock:
            sock.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (ROUTE.encode(), len(body), body))
            assert may_hang_up.wait(30)
        hung_up.set()
        held.result(30)

        deadline = time.monotonic() + 10
        while _client_aborts(scrape(stack.url)) == _client_aborts(before):
            assert time.monotonic() < deadline, "the hang-up was never counted as a client abort (499)"
            time.sleep(0.05)
        time.sleep(0.5)  # a job queued anyway reaches the worker well within this
        assert stack.worker.jobs[jobs:] == [], "a job was queued for a client already gone"
        assert _last_ids(r, streams) == ids
        after = scrape(stack.url)
        assert _client_aborts(after) - _client_aborts(before) == 1
        assert sample(after, "kvrelay_requests_in_flight", model=MODEL) == 0
        assert requests.post(f"{stack.url}{ROUTE}", json=BODY).status_code == 200  # and it serves on
