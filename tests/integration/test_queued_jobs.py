"""After a Redis restart the gateway asks Redis which queued jobs it still holds (gateway/queued_jobs.py),
against a real Redis: thousands of waiting requests over two streams are decided in one pipeline of a
few script calls (counted by Redis's own command statistics), a request with any job gone is lost, the
others keep waiting, and jobs already heard from or queued after the restart are not looked for."""

import math

import pytest
import redis

from kvrelay.gateway.queued_jobs import CHUNK, QueuedJobs
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
