"""A dead gateway harms nobody else, with real processes: two gateways, one prefill and one decode worker.
Gateway A is killed with -9 while its 48 streams run. Its process ends, so its event connections close:
its requests leave the decode batch through that (the test keeps A's liveness key fresh after the kill,
so waiting out the key's lapse, GATEWAY_TTL_S later, would never free them), and gateway B's streams go
on, also when A's requests held every decode seat and A's queued jobs were next in line for them: B's
streams get the seats and finish, and none of A's queued requests ever runs on the decode worker.
No bound on how fast: deadlines here only bound a hang on a loaded CI box."""

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.redis_conn import EmbeddedRedis
from tests.e2e.cluster import Cluster, free_port
from tests.e2e.conftest import TINY_ENGINE
from tests.e2e.sse_client import post_json

pytestmark = pytest.mark.slow
LONG_ENGINE = [*TINY_ENGINE, "--max-model-len", "512"]
ON_A, ON_B = 48, 8
GOING_ON = 20  # tokens each of B's streams gets once A's requests have left: its streams go on
SEATS = 16
HANG_S = 120  # far above any legitimate wait here: reaching it means something hung


def body(i: int, max_tokens: int) -> dict:
    # logprobs: each chunk names its tokens, so a stream's tokens are counted however they are chunked
    return {"model": "tiny", "prompt": [7 + i % 40, 8, 9], "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 0, "stream": True}


@dataclass
class Progress:
    tokens: int = 0  # from the chunks' logprobs: one chunk may carry more than one token
    ended: bool = False  # the stream ended, by itself or cut


async def stream_tokens(client: httpx.AsyncClient, url: str, payload: dict, progress: Progress) -> None:
    """Stream ``payload``, counting its tokens as they come; ends quietly when cancelled or cut."""
    try:
        async with client.stream("POST", url, json=payload) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and (choices := json.loads(line[6:]).get("choices")):
                    progress.tokens += sum(len((c.get("logprobs") or {}).get("tokens") or []) for c in choices)
    except httpx.HTTPError:
        pass  # gateway A's clients lose their connection: that is the point
    progress.ended = True


@contextlib.contextmanager
def two_gateways(model_dir, tmp_path, *decode_flags: str) -> Iterator[tuple[Cluster, int, int, int]]:
    """Embedded Redis, p1, d1 (with ``decode_flags``) and gateways A and B, ready: (the cluster, A's port,
    B's port, d1's metrics port); stopped after."""
    with EmbeddedRedis() as url:
        c = Cluster(url, str(model_dir), LONG_ENGINE, tmp_path)
        c.start_worker("prefill", "p1")
        metrics_port = free_port()
        c.start_worker("decode", "d1", extra=["--monitoring-port", str(metrics_port), *decode_flags])
        port_a = c.start_gateway("gw-a")
        port_b = c.start_gateway("gw-b")
        try:
            c.wait_ready(port=port_a)
            c.wait_ready(port=port_b)
            yield c, port_a, port_b, metrics_port
        finally:
            c.stop()


def test_a_killed_gateway_leaves_the_other_gateways_streams_and_the_decode_batch_clean(tiny_model_dir, tmp_path):
    with two_gateways(tiny_model_dir, tmp_path) as (c, port_a, port_b, metrics_port):
        new_request = asyncio.run(_kill_a_under_load(c, port_a, port_b, metrics_port))
        assert new_request.ok or new_request.status == 200, new_request
        assert c.procs["d1"].poll() is None and c.procs["p1"].poll() is None


async def until_tokens(streams: list[Progress], n: int = 5) -> None:
    """Every stream is decoding on d1."""
    async with asyncio.timeout(HANG_S):
        while not all(s.tokens >= n for s in streams):
            await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def beating_for(c: Cluster, name: str):
    """Keeps gateway ``name``'s liveness key fresh, with the value its process wrote, as if it still beat."""
    pid_suffix = f"-{c.procs[name].pid}".encode()
    (key, value), = [(k, v) for k in c.redis.scan_iter(keys.gateway_key("*"))
                     if (v := c.redis.get(k)) is not None and v.endswith(pid_suffix)]

    async def beat() -> None:
        while True:
            c.redis.set(key, value, ex=keys.GATEWAY_TTL_S)
            await asyncio.sleep(keys.GATEWAY_HEARTBEAT_S)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def metric(client: httpx.AsyncClient, metrics_port: int, name: str) -> float:
    """``name`` on the decode worker's Prometheus endpoint now, summed over its labels."""
    text = (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"{name}{{"))


async def running(client: httpx.AsyncClient, metrics_port: int) -> float:
    """The decode worker's running batch now."""
    return await metric(client, metrics_port, "vllm:num_requests_running")


async def ended_on_d1(client: httpx.AsyncClient, metrics_port: int) -> float:
    """Requests that ran on the decode worker and ended there, however they ended."""
    return await metric(client, metrics_port, "vllm:request_success_total")


def start_streams(client: httpx.AsyncClient, port: int, bodies: range,
                  max_tokens: int) -> tuple[list[Progress], list[asyncio.Task]]:
    """A stream of ``body(i, max_tokens)`` on the gateway at ``port`` for each i of ``bodies``: their progress
    and tasks."""
    progress = [Progress() for _ in bodies]
    tasks = [asyncio.create_task(stream_tokens(client, f"http://127.0.0.1:{port}/v1/completions",
                                               body(i, max_tokens), p)) for i, p in zip(bodies, progress, strict=True)]
    return progress, tasks


async def _kill_a_under_load(c: Cluster, port_a: int, port_b: int, metrics_port: int):
    async with httpx.AsyncClient(timeout=HANG_S, limits=httpx.Limits(max_connections=100)) as client:
        on_a, tasks = start_streams(client, port_a, range(ON_A), 500)
        await until_tokens(on_a)
        # B's streams start last, so they are still decoding when A's requests leave
        on_b, more = start_streams(client, port_b, range(100, 100 + ON_B), 500)
        tasks += more
        await until_tokens(on_b)
        assert await running(client, metrics_port) == ON_A + ON_B
        async with beating_for(c, "gw-a"):
            c.kill("gw-a")
            killed = time.monotonic()
            deadline = killed + HANG_S
            while await running(client, metrics_port) > ON_B:
                assert time.monotonic() < deadline, "A's requests still decoding:\n" + c.log("d1")[-3000:]
                await asyncio.sleep(0.1)
            left = [s.tokens for s in on_b]
            print(f"A's requests left the decode batch {time.monotonic() - killed:.2f}s after the kill")
            while not all(s.tokens >= n + GOING_ON or s.ended for s, n in zip(on_b, left, strict=True)):
                assert time.monotonic() < deadline, f"B's streams stalled at {[s.tokens for s in on_b]} tokens"
                await asyncio.sleep(0.1)
            assert all(s.tokens >= n + GOING_ON for s, n in zip(on_b, left, strict=True)), \
                f"B's streams did not go on once A's requests left: {left} tokens then, " \
                f"{[s.tokens for s in on_b]} at their end"
            new_request = await post_json(client, f"http://127.0.0.1:{port_b}/v1/completions",
                                          {**body(7, 8), "stream": False})
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return new_request


def test_a_killed_gateways_requests_give_their_decode_seats_to_the_other_gateway(tiny_model_dir, tmp_path):
    """Every decode seat is A's, and A's other 32 requests are prefilled and waiting for one when A dies:
    B's new streams get the seats and finish, and none of A's requests takes one after the kill."""
    with two_gateways(tiny_model_dir, tmp_path, "--max-num-seqs", str(SEATS)) as (c, port_a, port_b, metrics_port):
        on_b, ran_since_kill = asyncio.run(_kill_a_holding_every_seat(c, port_a, port_b, metrics_port))
        assert [s.tokens for s in on_b] == [30] * ON_B, "B's streams did not all complete"
        # A's requests that held the seats ended on d1, and B's: any more ran there after the kill
        assert ran_since_kill == SEATS + ON_B, f"{ran_since_kill:g} requests ended on d1 since the kill: " \
            f"A's queued requests took decode seats\n" + c.log("d1")[-3000:]


async def _kill_a_holding_every_seat(c: Cluster, port_a: int, port_b: int, metrics_port: int):
    async with httpx.AsyncClient(timeout=HANG_S, limits=httpx.Limits(max_connections=100)) as client:
        on_a, tasks = start_streams(client, port_a, range(ON_A), 500)
        async with asyncio.timeout(HANG_S):  # A's first streams decoding (past the first token from prefill)
            while sum(s.tokens >= 3 for s in on_a) < SEATS or await running(client, metrics_port) < SEATS:
                await asyncio.sleep(0.05)
        ended_before = await ended_on_d1(client, metrics_port)
        async with beating_for(c, "gw-a"):
            c.kill("gw-a")
            on_b, more = start_streams(client, port_b, range(100, 100 + ON_B), 30)
            tasks += more
            async with asyncio.timeout(HANG_S):  # B's streams end, then d1's batch is empty
                while not all(s.ended for s in on_b) or await running(client, metrics_port):
                    await asyncio.sleep(0.1)
            ran_since_kill = await ended_on_d1(client, metrics_port) - ended_before
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return on_b, ran_since_kill
