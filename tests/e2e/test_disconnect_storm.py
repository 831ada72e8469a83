"""Cancels free the hardware, with real processes: 100 or 200 clients stream 300 tokens each and all hang
up 0.5 s later, while their requests are everywhere at once (jobs in the stream, prompts in prefill, KV
on its way to the decode worker, requests in the decode batch; some with n=2). Every worker is idle
within IDLE_S, as its own metrics endpoint says, stays idle, and a request afterwards is served as it
was before the storm."""

import asyncio
import json
import time
import urllib.request

import httpx
import pytest

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.redis_conn import EmbeddedRedis
from kvrelay.shared.worker.intake import queued
from tests.e2e.cluster import Cluster, free_port
from tests.e2e.conftest import TINY_ENGINE

pytestmark = pytest.mark.slow
ENGINE = [*TINY_ENGINE, "--max-model-len", "512"]
MODEL = "tiny"
TOKENS = 300
HANG_UP_AFTER_S = 0.5
IDLE_S = 2.0  # the bound for the decode worker; measured 0.2-0.7 s on 2 CPU cores, every worker
STAY_IDLE_S = 1.0  # jobs still in the stream or in a handoff must not start anything later either
PENDING_S = 5.0  # for the last request's job to be acked after its client got every token
AFTER_SLACK_S = 3.0  # the request after the storm: within 3x its time before, plus this, on a loaded CI box


def gauges(port: int) -> tuple[float, float]:
    """vllm:num_requests_running and vllm:num_requests_waiting, from a worker's /metrics now."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    running = waiting = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            running += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:num_requests_waiting{"):
            waiting += float(line.rsplit(" ", 1)[1])
    return running, waiting


async def stream(http: httpx.AsyncClient, url: str, i: int, max_tokens: int) -> int:
    """Stream a completion; its completion tokens, as its usage chunk says."""
    body = {"model": MODEL, "prompt": [5 + i % 50, 6, 7, 8], "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "n": 2 if i % 10 == 0 else 1, "stream_options": {"include_usage": True}}
    tokens = 0
    async with http.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and (usage := json.loads(line[6:]).get("usage")):
                tokens = usage["completion_tokens"]
    return tokens


async def timed(http: httpx.AsyncClient, url: str) -> float:
    started = time.monotonic()
    assert await stream(http, url, 1, 10) == 10
    return time.monotonic() - started


@pytest.mark.parametrize(("mode", "clients"), [
    ("disaggregated", 100),
    ("disaggregated", 200),
    ("unified", 200)])
def test_a_disconnect_storm_leaves_every_worker_idle_at_once(tiny_model_dir, tmp_path, mode, clients):
    with EmbeddedRedis() as url:
        c = Cluster(url, str(tiny_model_dir), ENGINE, tmp_path)
        roles = [("prefill", "p1"), ("decode", "d1")] if mode == "disaggregated" else [("unified", "u1")]
        ports = {name: free_port() for _, name in roles}
        for role, name in roles:
            c.start_worker(role, name, ["--monitoring-port", str(ports[name])])
        c.start_gateway()
        try:
            c.wait_ready()
            idle_after, woke, before, after = asyncio.run(_storm(c, ports, clients))
            print(f"{mode}, {clients} disconnects: every worker idle {idle_after:.2f}s after the last one; "
                  f"a 10-token request {before:.2f}s before, {after:.2f}s after")
            assert idle_after <= IDLE_S, f"still busy {IDLE_S}s after {clients} clients left:\n" + "\n".join(
                c.log(name)[-2000:] for name in ports)
            assert not woke, f"a worker started work for a client that is gone: {woke}"
            # the request after the storm may end at its client a moment before its prefill worker acks its
            # job (the ack follows the handoff's): wait for the ack, but a job left pending is a leak
            deadline = time.monotonic() + PENDING_S
            while (pending := c.redis.xpending(keys.prefill_stream(MODEL), keys.PREFILL_GROUP)["pending"]) \
                    and time.monotonic() < deadline:
                time.sleep(0.1)
            assert pending == 0, f"{pending} jobs still pending {PENDING_S}s after the last request"
            assert after <= 3 * before + AFTER_SLACK_S
            for name in ports:
                assert c.procs[name].poll() is None, c.log(name)
        finally:
            c.stop()


def in_flight(c: Cluster) -> float:
    """kvrelay_requests_in_flight from the gateway's /metrics: requests whose handler has not ended."""
    with urllib.request.urlopen(f"http://127.0.0.1:{c.port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvrelay_requests_in_flight{"))


def idle(c: Cluster, ports: dict[str, int]) -> bool:
    """Nothing left anywhere: no job in the model's streams (ACKed jobs are deleted), and every worker's
    gauges at 0. A job still in Redis has no worker's gauge yet, but it may still start."""
    reader = "p1" if "p1" in ports else "u1"  # the worker reading the model's stream
    if queued(c.redis, MODEL, reader):
        return False
    return all(gauges(port) == (0, 0) for port in ports.values())


async def _storm(c: Cluster, ports: dict[str, int], clients: int):
    url = f"{c.base_url}/completions"
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=clients + 10)) as http:
        await timed(http, url)  # the first request of a process warms it up
        before = await timed(http, url)
        tasks = [asyncio.create_task(stream(http, url, i, TOKENS)) for i in range(clients)]
        await asyncio.sleep(HANG_UP_AFTER_S)
        for t in tasks:
            t.cancel()  # the connection closes: the gateway publishes the abort
        await asyncio.gather(*tasks, return_exceptions=True)
        # the clock starts once the gateway has let go of every request (each one's abort is on its way): it
        # hears of a hang-up only when its loop gets to it, and a job it queued meanwhile no worker could refuse
        deadline = time.monotonic() + 30
        while in_flight(c) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = time.monotonic()
        idle_after = float("inf")
        while time.monotonic() - left < IDLE_S + 5:  # past the bound: the message says how far past
            if idle(c, ports):
                idle_after = time.monotonic() - left
                break
            await asyncio.sleep(0.05)
        woke = {}
        quiet_until = time.monotonic() + STAY_IDLE_S
        while idle_after < float("inf") and time.monotonic() < quiet_until:
            for name, port in ports.items():
                if gauges(port) != (0, 0):
                    woke[name] = gauges(port)
            await asyncio.sleep(0.05)
        after = await timed(http, url)
    return idle_after, woke, before, after
