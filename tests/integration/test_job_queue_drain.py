"""JobQueue against a real redis-server: what drains and Redis outages rely on. ACKed jobs leave the
stream (its length is the backlog the gateway bounds), a failed ACK is retried by the next one, and a
handed-back job is taken by a peer's very next reclaim with its delivery count unchanged."""

import pytest

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.job_queue import JobQueue, replayable
from kvrelay.shared.wire.protocol import Job
from kvrelay.shared.wire.redis_conn import EmbeddedRedis, sync_client
from kvrelay.shared.wire.sampling_params import SamplingParams

MODEL = "m"
STREAM = keys.prefill_stream(MODEL)


@pytest.fixture()
def redis_client():
    with EmbeddedRedis() as url:
        yield sync_client(url)


def job(i: int, **sampling) -> Job:
    return Job(request_id=f"r{i}", model=MODEL, prompt_token_ids=[1, 2, 3], sampling=SamplingParams(**sampling),
               tenant="t", priority=0, reply_addr="tcp://127.0.0.1:1", deadline=0.0, arrival=0.0)


def queue_jobs(client, n: int) -> None:
    for i in range(n):
        client.xadd(STREAM, {keys.JOB_FIELD: encode(job(i))})


def test_acked_jobs_leave_the_stream(redis_client):
    q = JobQueue(redis_client, MODEL, "a", reclaim_idle_ms=60_000)
    queue_jobs(redis_client, 3)
    got = q.fetch(3, block_ms=0)
    assert redis_client.xlen(STREAM) == 3  # delivered, not done: still counted as backlog
    q.ack(*(entry for entry, _ in got))
    assert redis_client.xlen(STREAM) == 0
    assert redis_client.xpending(STREAM, keys.PREFILL_GROUP)["pending"] == 0


def test_a_failed_ack_is_retried_by_the_next(redis_client):
    q = JobQueue(redis_client, MODEL, "a", reclaim_idle_ms=60_000)
    queue_jobs(redis_client, 2)
    (first, _), (second, _) = q.fetch(2, block_ms=0)
    q.redis = sync_client("redis://127.0.0.1:1/0")  # Redis unreachable: the ACK must not raise
    q.ack(first)
    q.redis = redis_client
    assert redis_client.xpending(STREAM, keys.PREFILL_GROUP)["pending"] == 2
    q.ack(second)
    assert redis_client.xpending(STREAM, keys.PREFILL_GROUP)["pending"] == 0
    assert redis_client.xlen(STREAM) == 0


def test_handed_back_jobs_go_to_a_peer_at_once_with_their_delivery_count(redis_client):
    draining = JobQueue(redis_client, MODEL, "a", reclaim_idle_ms=60_000)
    peer = JobQueue(redis_client, MODEL, "b", reclaim_idle_ms=60_000)  # a long idle threshold on purpose
    queue_jobs(redis_client, 3)
    taken = draining.fetch(3, block_ms=0)
    assert peer.fetch(3, block_ms=0) == []  # nothing new, nothing idle long enough
    draining.hand_back([entry for entry, _ in taken[:2]])
    peer._last_reclaim = 0.0  # the peer's next reclaim pass (it runs one a second), without sleeping
    reclaimed = peer.fetch(3, block_ms=0)
    assert [j.request_id for _, j in reclaimed] == ["r0", "r1"]
    pending = redis_client.xpending_range(STREAM, keys.PREFILL_GROUP, "-", "+", 10)
    owners = {p["message_id"]: (p["consumer"], p["times_delivered"]) for p in pending}
    assert owners[taken[0][0]] == (b"b", 2) and owners[taken[2][0]] == (b"a", 1)  # the third stayed


def test_only_greedy_or_seeded_jobs_are_replayable():
    assert replayable(job(0, temperature=0.0))
    assert replayable(job(0, temperature=0.8, seed=7))
    assert not replayable(job(0, temperature=0.8, seed=None))
    assert not replayable(job(0))  # OpenAI's default temperature is 1
