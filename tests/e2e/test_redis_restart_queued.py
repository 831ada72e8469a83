"""Requests whose jobs were queued when Redis restarted: the gateway asks the new server which jobs it
kept. Real processes (a gateway, a unified worker), a real redis-server killed with -9 and started again
on its address, from its saved file or empty; real HTTP clients.

The worker is stopped (SIGSTOP) while the jobs are queued and while Redis restarts, so every job is
still in Redis then; it continues once the gateway has seen the restart. Jobs in the saved file survive
and their requests complete (one of them with n=2, two jobs; one streamed); a job queued after the save,
and every job of an empty restart, is gone, and its request ends at once with 503 ``queue_lost``."""

import asyncio
import signal
import time

import httpx
import pytest

from kvrelay.shared.wire import redis_keys as keys
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import TINY_ENGINE
from tests.e2e.load_records import until
from tests.e2e.restartable_redis import RestartableRedis
from tests.e2e.sse_client import Outcome, post_json, stream_completion

pytestmark = pytest.mark.slow
CLIENT_TIMEOUT_S = 120  # far above any answer here (the gateway's request timeout is its default 600 s)
# a hang bound, not a speed claim: a request whose job is gone is answered within it of the restart, far below
# the request timeout (600 s) a missed loss would wait out
LOST_BOUND_S = 120.0
POLL_S = 1.0  # the gateway's disconnect_poll_s: how often a waiting request looks at its state
# Redis is down here only until the gateway has seen it go, far shorter than this: every loss is found by
# asking the restarted server, never by an outage's timeout, however loaded the box
OUTAGE_S = 300.0
RESTARTED = "redis restarted (run_id"
UNREACHABLE = "redis unreachable:"


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    r = RestartableRedis()
    r.start()
    # a job that the stopped worker's blocked read had taken is its own pending one once it continues:
    # reclaimed after 1.5 s rather than the default 15
    c = Cluster(r.url, str(tiny_model_dir), TINY_ENGINE, tmp_path_factory.mktemp("queued"))
    c.start_worker("unified", "u1", ["--reclaim-idle-ms", "1500"])
    c.start_gateway(extra=["--redis-outage-s", str(OUTAGE_S)])
    try:
        c.wait_ready()
        yield r, c
    finally:
        c.stop()
        r.stop()


def body(i: int, **kw) -> dict:
    return {"model": "tiny", "prompt": [5 + i, 6, 7], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True, **kw}


def queued_jobs(c: Cluster) -> int:
    """Jobs in Redis for the model: the shared stream and the worker's private one (entries stay until
    the worker ACKs them)."""
    return c.redis.xlen(keys.prefill_stream("tiny")) + c.redis.xlen(keys.prefill_worker_stream("tiny", "u1"))


def _restarts_seen(c: Cluster) -> int:
    return c.log("gateway").count(RESTARTED)


async def _kill_until_seen(r: RestartableRedis, c: Cluster) -> None:
    """Kill Redis and return once the gateway has found it unreachable: down, not yet an outage (OUTAGE_S)."""
    seen = c.log("gateway").count(UNREACHABLE)
    r.kill()
    await until(lambda: c.log("gateway").count(UNREACHABLE) > seen, 60, "the gateway to see Redis down")


async def _queue(c: Cluster, client: httpx.AsyncClient, reqs: list[tuple[dict, bool]]) -> list[asyncio.Task]:
    """Send (body, streamed) requests; return once all their jobs are in Redis."""
    url = f"{c.base_url}/completions"
    before = queued_jobs(c)
    tasks = [asyncio.create_task((stream_completion if streamed else post_json)(client, url, b)) for b, streamed in reqs]
    jobs = sum(b.get("n", 1) for b, _ in reqs)
    await until(lambda: queued_jobs(c) == before + jobs, 30, f"{jobs} jobs queued")
    return tasks


def _lost(out: Outcome) -> bool:
    """Ended with 503 queue_lost: as the response status, or as the error event of a stream already begun."""
    return out.code == "queue_lost" and (out.status == 503 and out.headers.get("retry-after") or out.status == 200)


def test_jobs_the_restored_redis_kept_are_served_and_the_one_it_lost_fails_at_once(stack):
    r, c = stack
    kept = [(body(1), False), (body(2, n=2), False), (body(3), True)]

    async def run() -> tuple[list[Outcome], Outcome, float]:
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as client:
            c.signal("u1", signal.SIGSTOP)  # nobody reads: every job stays in Redis
            try:
                kept_tasks = await _queue(c, client, kept)
                r.save()  # what the restarted server will hold
                [late] = await _queue(c, client, [(body(4), False)])  # not in the file
                seen = _restarts_seen(c)
                await _kill_until_seen(r, c)
                restarted = time.monotonic()
                r.start(keep_data=True)
                late_out = await asyncio.wait_for(late, LOST_BOUND_S)
                lost_after = time.monotonic() - restarted
                assert _restarts_seen(c) > seen, c.log("gateway")[-3000:]
                await asyncio.sleep(3 * POLL_S)  # each request looked at its state since the restart check
                assert not any(t.done() for t in kept_tasks), [t.result() for t in kept_tasks if t.done()]
            finally:
                c.signal("u1", signal.SIGCONT)
            outs = await asyncio.gather(*kept_tasks)
            return outs, late_out, lost_after

    outs, late, lost_after = asyncio.run(run())
    print(f"\n[restored Redis] the lost request answered {lost_after:.2f} s after the restart; kept: "
          f"{[(o.status, o.finish_reason, o.completion_tokens) for o in outs]}")
    assert _lost(late), late
    for (b, _), out in zip(kept, outs, strict=True):
        assert out.ok, out
        assert out.finish_reason == "length", out
        if out.completion_tokens is not None:
            assert out.completion_tokens == 4 * b.get("n", 1), out


def test_an_empty_restart_fails_every_queued_request_at_once(stack):
    r, c = stack
    reqs = [(body(11), False), (body(12, n=2), False), (body(13), True)]

    async def run() -> tuple[list[Outcome], float]:
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as client:
            c.signal("u1", signal.SIGSTOP)
            try:
                tasks = await _queue(c, client, reqs)
                await _kill_until_seen(r, c)
                restarted = time.monotonic()
                r.start(keep_data=False)
                outs = await asyncio.wait_for(asyncio.gather(*tasks), LOST_BOUND_S)
                return outs, time.monotonic() - restarted
            finally:
                c.signal("u1", signal.SIGCONT)

    outs, took = asyncio.run(run())
    print(f"\n[empty Redis] all {len(outs)} queued requests answered {took:.2f} s after the restart")
    assert all(_lost(o) for o in outs), outs
    # the worker re-registers with the new server and serves again
    after = asyncio.run(_one(c))
    assert after.ok, after


async def _one(c: Cluster) -> Outcome:
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as client:
        deadline = time.monotonic() + 60
        while True:
            out = await post_json(client, f"{c.base_url}/completions", body(20))
            if out.ok or time.monotonic() > deadline:
                return out
            await asyncio.sleep(0.5)  # the worker re-registering with the empty server: 503 until then
