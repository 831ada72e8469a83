"""After a Redis restart the gateway asks Redis which queued jobs it still holds (gateway/queued_jobs.py),
against a real Redis: thousands of waiting requests over two streams are decided in one pipeline of a
few script calls (counted by Redis's own command statistics), a request with any job gone is lost, the
others keep waiting, and jobs already heard from or queued after the restart are not looked for; the
Redis watch runs that check on a new run_id and gives a check Redis keeps refusing up after outage_s."""

import asyncio
import math
import time

import pytest
import redis

from kvrelay.gateway.queued_jobs import CHUNK, QueuedJobs
from kvrelay.gateway.redis_watch import RedisWatch
from kvrelay.shared.wire.redis_conn import async_client, sync_client

pytestmark = pytest.mark.timeout(60)
SHARED, PRIVATE = "test:queued:shared", "test:queued:private"
N = 2500  # waiting requests: more than two script calls' worth of ids on the shared stream


def _eval_calls(r: redis.Redis) -> int:
    return r.info("commandstats").get("cmdstat_eval", {}).get("calls", 0)


@pytest.fixture()
def r(redis_url):
    client = sync_client(redis_url)
    client.delete(SHARED, PRIVATE)
    yield client
    client.delete(SHARED, PRIVATE)
    client.close()


async def test_thousands_of_requests_are_decided_in_one_pipeline(r, redis_url):
    pipe = r.pipeline(transaction=False)
    for i in range(N):
        pipe.xadd(SHARED, {"job": f"s{i}"})
    for i in range(N // 5):
        pipe.xadd(PRIVATE, {"job": f"p{i}"})
    ids = pipe.execute()
    shared_ids, private_ids = ids[:N], ids[N:]
    client = async_client(redis_url)
    try:
        queued = QueuedJobs(client)
        requests = []
        for i in range(N):
            jobs = {f"r{i}-0": (SHARED, shared_ids[i])}
            if i % 5 == 0:  # n=2: its second job went to the private stream
                jobs[f"r{i}-1"] = (PRIVATE, private_ids[i // 5])
            requests.append(queued.add(1.0, jobs))
        # gone from the restarted server: a shared job, a private one, and a whole stream's worth for one
        r.xdel(SHARED, shared_ids[7], shared_ids[11])
        r.xdel(PRIVATE, private_ids[2])  # request 10's second job
        heard = requests[11]
        heard.heard("r11-0")  # a worker answered for it: not in Redis any more, and not lost
        late = queued.add(5.0, {"late-0": (SHARED, b"1-1")})  # queued into the new server: not looked for
        missing_stream = queued.add(1.0, {"m-0": ("test:queued:none", b"1-1")})

        before = _eval_calls(r)
        checked, lost = await queued.recheck(queued_before=2.0)
        calls = _eval_calls(r) - before
    finally:
        await client.aclose()

    assert calls == math.ceil(N / CHUNK) + math.ceil((N // 5) / CHUNK) + 1, calls
    assert checked == N  # every request queued before, less the heard one, plus the missing stream's
    assert lost == 3
    assert {i for i, q in enumerate(requests) if q.lost} == {7, 10}
    assert requests[10].gone == {"r10-1"}
    assert not heard.lost and not late.lost
    assert missing_stream.lost
    # an answer from the worker for a job thought gone (it was read and ACKed) clears it
    requests[7].heard("r7-0")
    assert not requests[7].lost


async def test_nothing_waiting_costs_no_round_trip(r, redis_url):
    client = async_client(redis_url)
    before = _eval_calls(r)
    try:
        queued = QueuedJobs(client)
        done = queued.add(1.0, {"a-0": (SHARED, b"1-1")})
        done.heard("a-0")
        queued.discard(queued.add(1.0, {"b-0": (SHARED, b"1-2")}))
        assert await queued.recheck(queued_before=2.0) == (0, 0)
        assert len(queued) == 1
        assert _eval_calls(r) == before
    finally:
        await client.aclose()


async def test_the_watch_checks_on_a_new_run_id_and_gives_up_after_outage_s(r, redis_url):
    """The watch steps as it does on a restart (the server's run_id differs from the one it knew): kept
    jobs wait, a gone one is lost. A check Redis keeps refusing (here a stream key of the wrong type) is
    tried again at each probe and given up after ``outage_s``: then every request queued before the
    restart counts as lost, as after an outage, instead of waiting out its deadline."""
    kept_id = r.xadd(SHARED, {"job": "kept"})
    client = async_client(redis_url)
    try:
        watch = RedisWatch(client, interval=0.05, outage_s=1.0)
        await watch.check()
        kept = watch.queued.add(time.monotonic(), {"k-0": (SHARED, kept_id)})
        gone = watch.queued.add(time.monotonic(), {"g-0": (SHARED, b"1-1")})
        watch.run_id = "a-server-before-the-restart"
        await watch.check()
        assert not kept.lost and gone.lost
        assert not watch.lost(kept.queued_at)

        r.set(PRIVATE, "not a stream")
        refused = watch.queued.add(time.monotonic(), {"x-0": (PRIVATE, b"1-1")})
        watch.run_id = "another-server-before-the-restart"
        await watch.check()
        assert not refused.lost and not watch.lost(refused.queued_at)  # not decided yet: tried again
        deadline = time.monotonic() + 10
        while not watch.lost(refused.queued_at):
            assert time.monotonic() < deadline, "the failing check was never given up"
            await asyncio.sleep(0.05)
            await watch.check()
        assert watch.lost(kept.queued_at)  # the check covers every request queued before: all count as lost
        assert watch.health.reachable  # a refused command is no outage
    finally:
        await client.aclose()
