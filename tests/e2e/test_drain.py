"""Graceful drain on SIGTERM, with real processes: gateway, prefill, unified and decode workers.

SIGSTOP/SIGCONT hold a process still so a test can be sure requests are in flight when the drain starts
(a stopped process gets SIGTERM delivered when it continues); no test asserts on timing, only on what
finished, what was refused, what was handed back and that every process exits and unregisters."""

import asyncio
import signal

import httpx
import pytest

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.redis_conn import EmbeddedRedis
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import TINY_ENGINE
from tests.e2e.sse_client import post_json, stream_completion

pytestmark = pytest.mark.slow
STREAM = keys.prefill_stream("tiny")


@pytest.fixture(scope="module")
def redis_url():
    with EmbeddedRedis() as url:
        yield url


@pytest.fixture(scope="module")
def workers(tiny_model_dir, tmp_path_factory):
    """One prefill and one decode worker, on a Redis of their own, for the gateway tests: they only
    ever pause these workers, so each test needs just a gateway of its own."""
    with EmbeddedRedis() as url:
        c = Cluster(url, str(tiny_model_dir), TINY_ENGINE, tmp_path_factory.mktemp("drain-workers"))
        c.start_worker("prefill", "p1")
        c.start_worker("decode", "d1")
        c.start_gateway("g0")
        c.wait_ready()
        yield c
        c.stop()


@pytest.fixture()
def cluster(tiny_model_dir, redis_url, tmp_path):
    c = Cluster(redis_url, str(tiny_model_dir), TINY_ENGINE, tmp_path)
    c.redis.flushall()
    yield c
    c.stop()


def body(i: int, max_tokens: int = 200, **kw) -> dict:
    # logprobs: every token makes a chunk, even one whose text is held back (a partial UTF-8 byte)
    return {"model": "tiny", "prompt": [7 + i, 8, 9], "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 0, **kw}


async def until(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    """Bounded wait: poll ``predicate`` (sync or async) until true."""
    async with asyncio.timeout(timeout):
        while True:
            value = predicate()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return
            await asyncio.sleep(0.1)


async def start_streams(client, url, bodies, min_chunks: int = 1):
    """Start one stream per body; return their tasks once each has at least ``min_chunks`` chunks."""
    seen = [asyncio.Event() for _ in bodies]
    tasks = [asyncio.create_task(stream_completion(client, url, b, first_chunk=e, min_chunks=min_chunks))
             for b, e in zip(bodies, seen, strict=True)]
    await until(lambda: all(e.is_set() for e in seen), what="first chunks")
    return tasks


def wait_gateway(c: Cluster, port: int) -> None:
    """Bounded wait for one more gateway's /ready (Cluster.wait_ready would trip over an earlier test's
    gateway, which drained and exited)."""
    async def ready():
        async with httpx.AsyncClient(timeout=5) as client:
            await until(lambda: _status(client, f"http://127.0.0.1:{port}/ready", 200), what="gateway ready")

    asyncio.run(ready())


def wait_exit(c: Cluster, name: str, timeout: float = 40.0) -> int:
    code = c.procs[name].wait(timeout)
    assert c.worker(name) is None, f"{name} still registered after it exited"
    return code


def test_gateway_drain_finishes_in_flight_and_refuses_new(workers):
    c = workers
    port = c.start_gateway("g1", extra=["--drain-timeout", "60"])
    wait_gateway(c, port)
    base = f"http://127.0.0.1:{port}"

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            tasks = await start_streams(client, f"{base}/v1/completions", [body(i) for i in range(4)])
            c.signal("d1", signal.SIGSTOP)  # hold the streams in flight while the gateway drains
            c.signal("g1", signal.SIGTERM)
            await until(lambda: _status(client, f"{base}/ready", 503), what="/ready to fail")
            health = await client.get(f"{base}/health")
            refused = await post_json(client, f"{base}/v1/completions", body(9, max_tokens=4))
            still_running = c.procs["g1"].poll() is None
            c.signal("d1", signal.SIGCONT)
            return health.status_code, refused, still_running, await asyncio.gather(*tasks)

    health, refused, still_running, results = asyncio.run(run())
    assert health == 200  # liveness stays green while draining
    assert (refused.status, refused.code) == (503, "shutting_down")
    assert refused.headers.get("retry-after") and refused.headers.get("connection") == "close"
    assert still_running
    for r in results:
        assert r.ok and r.finish_reason == "length", r
    assert wait_exit(c, "g1") == 0


def test_gateway_drain_timeout_ends_streams_cleanly_and_frees_kv(workers):
    c = workers
    port = c.start_gateway("g2", extra=["--drain-timeout", "1"])
    wait_gateway(c, port)
    total = c.wait_worker("d1").total_blocks

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            tasks = await start_streams(client, f"http://127.0.0.1:{port}/v1/completions",
                                        [body(i) for i in range(3)])
            c.signal("d1", signal.SIGSTOP)  # the streams cannot finish: the drain must time out
            c.signal("g2", signal.SIGTERM)
            results = await asyncio.gather(*tasks)
            code = await asyncio.to_thread(wait_exit, c, "g2")
            c.signal("d1", signal.SIGCONT)
            # the gateway published aborts before it exited: the decode worker frees every block
            await until(lambda: (w := c.worker("d1")) is not None and w.running == 0 and w.free_blocks == total,
                        what="decode blocks freed")
            return results, code

    results, code = asyncio.run(run())
    assert code == 0
    for r in results:
        assert (r.status, r.code, r.done) == (200, "shutting_down", True), r


def test_prefill_drain_hands_unfinished_jobs_back(cluster):
    c = cluster
    c.start_worker("prefill", "p1", ["--drain-timeout", "1", "--handoff-timeout", "60"])
    c.start_worker("decode", "d1")
    port = c.start_gateway()
    c.wait_ready()
    url = f"http://127.0.0.1:{port}/v1/completions"
    c.signal("d1", signal.SIGSTOP)  # p1 prefills, then waits on a grant: its jobs stay in flight

    async def run():
        async with httpx.AsyncClient(timeout=90) as client:
            bodies = [body(i, max_tokens=12) for i in range(3)] + [body(3, max_tokens=12, temperature=1.0)]
            tasks = await start_streams(client, url, bodies)  # first tokens came from p1: all in handoff
            c.signal("p1", signal.SIGSTOP)  # SIGTERM first, then a job arrives that p1 must not take
            c.signal("p1", signal.SIGTERM)
            late = asyncio.create_task(post_json(client, url, body(5, max_tokens=12)))
            await until(lambda: c.redis.xlen(STREAM) == 5, what="the late job queued")
            c.signal("p1", signal.SIGCONT)
            code = await asyncio.to_thread(wait_exit, c, "p1")
            pending = c.redis.xpending(STREAM, keys.PREFILL_GROUP)["pending"]
            queued = c.redis.xlen(STREAM)
            c.start_worker("prefill", "p2")  # default reclaim idle (15 s): handed-back jobs go at once
            c.signal("d1", signal.SIGCONT)
            results = await asyncio.gather(*tasks, late)
            fresh = await post_json(client, url, body(0, max_tokens=12))
            return code, pending, queued, results, fresh

    code, pending, queued, results, fresh = asyncio.run(run())
    assert code == 0
    # The three greedy jobs were handed back: still pending, nothing lost. The late one was either left
    # in the stream or, when p1 was stopped inside a blocking XREADGROUP that Redis then answered with
    # it, delivered to p1 and handed back too. The sampled one was ended, so it left the stream.
    assert queued == 4 and pending in (3, 4)
    *greedy, sampled, late = results
    for r in greedy + [late]:
        assert r.ok and r.finish_reason == "length", r
    # the sampled job had sent a first token a peer would not repeat: it ends cleanly instead
    assert sampled.status == 200 and sampled.error and sampled.done, sampled
    assert greedy[0].text == fresh.text  # a handed-back stream continues exactly where it was
    assert c.redis.xpending(STREAM, keys.PREFILL_GROUP)["pending"] == 0
    assert c.redis.xlen(STREAM) == 0


def test_unified_drain_finishes_running_and_leaves_queue_to_successor(cluster):
    c = cluster
    c.start_worker("unified", "u1")
    port = c.start_gateway()
    c.wait_ready()
    url = f"http://127.0.0.1:{port}/v1/completions"

    async def run():
        async with httpx.AsyncClient(timeout=90) as client:
            tasks = await start_streams(client, url, [body(i) for i in range(4)])
            c.signal("u1", signal.SIGSTOP)  # SIGTERM lands while all four are running
            late = asyncio.create_task(post_json(client, url, body(5, max_tokens=6)))
            await until(lambda: c.redis.xlen(STREAM) == 5, what="the late job queued")
            c.signal("u1", signal.SIGTERM)
            c.signal("u1", signal.SIGCONT)
            results = await asyncio.gather(*tasks)
            code = await asyncio.to_thread(wait_exit, c, "u1")
            left = c.redis.xlen(STREAM), c.redis.xpending(STREAM, keys.PREFILL_GROUP)["pending"]
            c.start_worker("unified", "u2")
            return results, code, left, await late

    results, code, left, late = asyncio.run(run())
    for r in results:
        assert r.ok and r.finish_reason == "length", r
    assert code == 0
    # the draining worker never started the late job: it waited in the stream, or, when SIGTERM landed
    # during the read that fetched it, was handed back (still pending, claimable by the successor)
    assert left in ((1, 0), (1, 1)), left
    assert late.ok, late


def test_decode_drain_finishes_then_ends_the_rest_with_an_error(cluster):
    c = cluster
    c.start_worker("prefill", "p1")
    c.start_worker("decode", "d1", ["--drain-timeout", "60"])
    port = c.start_gateway()
    c.wait_ready()
    url = f"http://127.0.0.1:{port}/v1/completions"

    async def run():
        async with httpx.AsyncClient(timeout=90) as client:
            first = await start_streams(client, url, [body(i) for i in range(3)], min_chunks=2)
            c.start_worker("decode", "d2", ["--drain-timeout", "0"])
            await asyncio.to_thread(c.wait_worker, "d2")
            c.signal("d1", signal.SIGSTOP)
            c.signal("d1", signal.SIGTERM)
            c.signal("d1", signal.SIGCONT)
            during = await post_json(client, url, body(6, max_tokens=8))  # must go to d2
            finished = await asyncio.gather(*first)
            d1_code = await asyncio.to_thread(wait_exit, c, "d1")
            second = await start_streams(client, url, [body(i) for i in range(2)], min_chunks=2)
            c.signal("d2", signal.SIGTERM)  # drain timeout 0: what runs ends at once
            cut = await asyncio.gather(*second)
            d2_code = await asyncio.to_thread(wait_exit, c, "d2")
            return finished, during, d1_code, cut, d2_code

    finished, during, d1_code, cut, d2_code = asyncio.run(run())
    for r in finished:
        assert r.ok and r.finish_reason == "length", r
    assert during.ok, during
    for r in cut:
        assert r.status == 200 and r.error and "shut down" in r.error and r.done, r
    assert (d1_code, d2_code) == (0, 0)
    assert c.redis.xpending(STREAM, keys.PREFILL_GROUP)["pending"] == 0


async def _status(client: httpx.AsyncClient, url: str, status: int) -> bool:
    try:
        return (await client.get(url)).status_code == status
    except httpx.TransportError:  # not listening yet
        return False
