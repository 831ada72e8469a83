"""Failure and overload behaviour with real processes: a Redis restart under load, bounded queues, and
request deadlines that end work downstream. Clients must get fast, retryable answers (an HTTP timeout
in these tests would mean a hang, and fails them), and the service must come back by itself."""

import asyncio
import signal

import httpx
import pytest

from kvrelay.shared.wire import redis_keys as keys
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import TINY_ENGINE
from tests.e2e.restartable_redis import RestartableRedis
from tests.e2e.sse_client import post_json, stream_completion

pytestmark = pytest.mark.slow
STREAM = keys.prefill_stream("tiny")
CLIENT_TIMEOUT_S = 60  # far above any legitimate answer here: hitting it means something hung


@pytest.fixture()
def restartable_redis():
    r = RestartableRedis()
    r.start()
    yield r
    r.stop()


def body(i: int, max_tokens: int = 4, **kw) -> dict:
    return {"model": "tiny", "prompt": [5 + i % 50, 6, 7], "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, **kw}


def test_redis_restart_under_load_gives_retryable_errors_and_recovers(tiny_model_dir, restartable_redis, tmp_path):
    r = restartable_redis
    c = Cluster(r.url, str(tiny_model_dir), TINY_ENGINE, tmp_path)
    c.start_worker("prefill", "p1")
    c.start_worker("decode", "d1")
    port = c.start_gateway()
    try:
        c.wait_ready()
        pids = {name: proc.pid for name, proc in c.procs.items()}
        outcomes, phase = [], {"now": "before"}
        stop = asyncio.Event()

        async def load(client, n):
            i = n
            while not stop.is_set():
                i += 4
                url = f"http://127.0.0.1:{port}/v1/completions"
                out = await (stream_completion if i % 8 < 4 else post_json)(client, url, body(i))
                outcomes.append((phase["now"], out))
                if out.status != 200:
                    await asyncio.sleep(0.05)  # what a client honouring Retry-After would do, shortened

        def count(which, ok=True):
            return sum(1 for p, o in outcomes if p == which and o.ok == ok)

        async def run():
            async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as client:
                tasks = [asyncio.create_task(load(client, n)) for n in range(4)]
                await _until(lambda: count("before") >= 20)
                phase["now"] = "down"
                r.kill()
                await _until(lambda: count("down", ok=False) >= 8)  # clients are answered while it is down
                phase["now"] = "after"
                r.start()  # a new, empty Redis on the same port
                await _until(lambda: count("after") >= 20, timeout=90)
                stop.set()
                await asyncio.gather(*tasks)

        asyncio.run(run())
        for name, proc in c.procs.items():  # nothing was restarted: the same processes recovered
            assert proc.poll() is None and proc.pid == pids[name], f"{name} died:\n{c.log(name)[-3000:]}"
        for which, out in outcomes:
            if out.ok:
                continue
            assert out.status in (200, 503), (which, out)
            # refused at once (503 + Retry-After), or a stream whose queued job was lost ended cleanly
            assert out.headers.get("retry-after") or (out.done and out.code in ("queue_lost", "queue_unavailable")), \
                (which, out)
        assert c.worker("p1") and c.worker("d1")  # re-registered with the new server
        assert c.redis.exists(keys.model_key("tiny"))  # the model re-published
        assert any(g["name"] == keys.PREFILL_GROUP.encode() for g in c.redis.xinfo_groups(STREAM))
    finally:
        c.stop()


@pytest.fixture(scope="module")
def paused_cluster(tiny_model_dir, tmp_path_factory):
    """Workers plus a gateway with a queue bound of 4 and a 3 s request timeout."""
    r = RestartableRedis()
    r.start()
    c = Cluster(r.url, str(tiny_model_dir), TINY_ENGINE, tmp_path_factory.mktemp("overload"))
    c.start_worker("prefill", "p1")
    c.start_worker("decode", "d1")
    c.start_gateway(extra=["--max-queue-depth", "4", "--request-timeout", "3"])
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()
        r.stop()


def test_full_queue_answers_429_with_retry_after(paused_cluster):
    c = paused_cluster
    url = f"{c.base_url}/completions"
    c.signal("p1", signal.SIGSTOP)  # nobody takes jobs: the queue only grows

    async def run():
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as client:
            queued = [asyncio.create_task(post_json(client, url, body(i))) for i in range(4)]
            await _until(lambda: c.redis.xlen(STREAM) == 4)
            refused = await asyncio.gather(*(post_json(client, url, body(9 + i)) for i in range(3)))
            c.signal("p1", signal.SIGCONT)
            return refused, await asyncio.gather(*queued)

    try:
        refused, queued = asyncio.run(run())
    finally:
        c.signal("p1", signal.SIGCONT)
    for out in refused:
        assert (out.status, out.code) == (429, "queue_full") and int(out.headers["retry-after"]) > 0, out
    for out in queued:  # the 3 s deadline is long enough once p1 runs again
        assert out.ok, out
    # ACKed entries are deleted, so the length is the backlog; a worker ACKs a finished job on its next read,
    # which may come a moment after the client got its last token
    asyncio.run(_until(lambda: c.redis.xlen(STREAM) == 0, timeout=10))


def test_deadline_ends_the_request_and_its_job(paused_cluster):
    c = paused_cluster
    c.signal("p1", signal.SIGSTOP)

    async def run():
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as client:
            return await post_json(client, f"{c.base_url}/completions", body(1, max_tokens=50))

    try:
        out = asyncio.run(run())
    finally:
        c.signal("p1", signal.SIGCONT)
    assert (out.status, out.code) == (504, "timeout"), out
    # p1 wakes up to a job its gateway gave up on (the abort it published at the 504; the job's own deadline,
    # the workers' backstop, lies --model-load-timeout later): it drops it (ACKs, never prefills), nothing stays queued
    asyncio.run(_until(lambda: c.redis.xlen(STREAM) == 0))
    assert c.redis.xpending(STREAM, keys.PREFILL_GROUP)["pending"] == 0
    # nothing leaked on d1 either: its registration is a heartbeat's snapshot, which may predate the release of
    # the blocks of the last request before this test (the module's cluster is shared), so it is read until it
    # shows every block free; a leak never does
    c.wait_worker("d1")

    def all_free() -> bool:
        d1 = c.worker("d1")
        return d1 is not None and d1.running == 0 and d1.free_blocks == d1.total_blocks

    asyncio.run(_until(all_free))


async def _until(predicate, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.05)
