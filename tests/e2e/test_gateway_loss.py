"""A dead gateway harms nobody else, with real processes: two gateways, one prefill and one decode worker.
Gateway A is killed with -9 while both gateways stream long completions: gateway B's streams go on with
no gap over a second, its new requests are served, and A's requests leave the decode batch within 10 s
(A's liveness key lapses, or A stops taking its events)."""

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import httpx
import pytest

from kvrelay.shared.wire.redis_conn import EmbeddedRedis
from tests.e2e.cluster import Cluster, free_port
from tests.e2e.conftest import TINY_ENGINE
from tests.e2e.sse_client import post_json

pytestmark = pytest.mark.slow
LONG_ENGINE = [*TINY_ENGINE, "--max-model-len", "512"]
ON_A, ON_B = 48, 8
MAX_GAP_S = 1.0
LEAVE_BATCH_S = 10.0
CLIENT_TIMEOUT_S = 60


def body(i: int, max_tokens: int) -> dict:
    # logprobs: every token makes a chunk, even one whose text is held back (a partial UTF-8 byte)
    return {"model": "tiny", "prompt": [7 + i % 40, 8, 9], "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 0, "stream": True}


@dataclass
class Stamps:
    times: list[float] = field(default_factory=list)  # monotonic arrival of each chunk
    ended: float = math.inf  # when the stream ended by itself


async def stream_times(client: httpx.AsyncClient, url: str, payload: dict, stamps: Stamps) -> None:
    """Stream ``payload``, stamping each chunk's arrival; ends quietly when cancelled or cut."""
    try:
        async with client.stream("POST", url, json=payload) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                    stamps.times.append(time.monotonic())
    except httpx.HTTPError:
        pass  # gateway A's clients lose their connection: that is the point
    stamps.ended = time.monotonic()


def test_a_killed_gateway_leaves_the_other_gateways_streams_and_the_decode_batch_clean(tiny_model_dir, tmp_path):
    with EmbeddedRedis() as url:
        c = Cluster(url, str(tiny_model_dir), LONG_ENGINE, tmp_path)
        c.start_worker("prefill", "p1")
        metrics_port = free_port()
        c.start_worker("decode", "d1", extra=["--monitoring-port", str(metrics_port)])
        port_a = c.start_gateway("gw-a")
        port_b = c.start_gateway("gw-b")
        try:
            c.wait_ready(port=port_a)
            c.wait_ready(port=port_b)
            gaps, left_after, new_request = asyncio.run(_kill_a_under_load(c, port_a, port_b, metrics_port))
            assert max(gaps) <= MAX_GAP_S, f"gateway B's streams stalled for {max(gaps):.2f}s"
            assert left_after is not None, f"A's requests still decoding {LEAVE_BATCH_S}s after the kill:\n" \
                                           + c.log("d1")[-3000:]
            assert new_request.ok or new_request.status == 200, new_request
            assert c.procs["d1"].poll() is None and c.procs["p1"].poll() is None
        finally:
            c.stop()


async def until_chunks(streams: list[Stamps], n: int = 5) -> None:
    """Every stream is decoding on d1."""
    async with asyncio.timeout(90):
        while not all(len(s.times) >= n for s in streams):
            await asyncio.sleep(0.1)


async def running(client: httpx.AsyncClient, metrics_port: int) -> float:
    """The decode worker's running batch, as its Prometheus endpoint says now."""
    text = (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running{"))


async def _kill_a_under_load(c: Cluster, port_a: int, port_b: int, metrics_port: int):
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, limits=httpx.Limits(max_connections=100)) as client:
        on_a = [Stamps() for _ in range(ON_A)]
        on_b = [Stamps() for _ in range(ON_B)]
        tasks = [asyncio.create_task(stream_times(client, f"http://127.0.0.1:{port_a}/v1/completions",
                                                  body(i, 500), on_a[i])) for i in range(ON_A)]
        await until_chunks(on_a)
        # B's streams start last, so they outlast the 10 s watched after the kill
        tasks += [asyncio.create_task(stream_times(client, f"http://127.0.0.1:{port_b}/v1/completions",
                                                   body(100 + i, 500), on_b[i])) for i in range(ON_B)]
        await until_chunks(on_b)
        c.kill("gw-a")
        killed = time.monotonic()
        assert await running(client, metrics_port) == ON_A + ON_B
        left_after = None
        while left_after is None and time.monotonic() - killed < LEAVE_BATCH_S:
            if await running(client, metrics_port) <= ON_B:
                left_after = time.monotonic() - killed
            await asyncio.sleep(0.25)
        await asyncio.sleep(max(0.0, killed + LEAVE_BATCH_S - time.monotonic()))  # B watched for 10 s at least
        new_request = await post_json(client, f"http://127.0.0.1:{port_b}/v1/completions",
                                      {**body(7, 8), "stream": False})
        watched_until = time.monotonic()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    gaps = []
    for s in on_b:
        after = [killed, *(t for t in s.times if killed <= t <= watched_until), min(s.ended, watched_until)]
        gaps.append(max(b - a for a, b in zip(after, after[1:], strict=False)))
    return gaps, left_after, new_request

