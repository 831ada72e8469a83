"""The prefill job stream against a real Redis: consumer group delivery, reclaim of a dead consumer's
pending jobs, dead-lettering of poison and malformed jobs, and recovery from a Redis that lost its
group."""

import time

import pytest

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.redis_conn import sync_client
from tests.integration.job_queue_harness import MODEL, make_job, make_queue


@pytest.fixture()
def r(redis_url):
    client = sync_client(redis_url)
    client.flushall()
    return client


def test_each_job_goes_to_one_consumer_and_ack_clears_it(r):
    a, b = make_queue(r, "a", idle_ms=60_000), make_queue(r, "b", idle_ms=60_000)
    for i in range(4):
        r.xadd(keys.prefill_stream(MODEL), {keys.JOB_FIELD: encode(make_job(f"r{i}"))})
    got_a = a.fetch(2, block_ms=10)
    got_b = b.fetch(10, block_ms=10)
    ids = sorted(j.request_id for _, j in got_a + got_b)
    assert ids == ["r0", "r1", "r2", "r3"] and len(got_a) == 2
    for entry_id, _ in got_a + got_b:
        (a if (entry_id, _) in got_a else b).ack(entry_id)
    assert r.xpending(keys.prefill_stream(MODEL), keys.PREFILL_GROUP)["pending"] == 0


def test_dead_consumers_jobs_are_reclaimed_then_dead_lettered(r):
    dead = []
    r.xadd(keys.prefill_stream(MODEL), {keys.JOB_FIELD: encode(make_job("poison"))})
    assert [j.request_id for _, j in make_queue(r, "w1").fetch(1, block_ms=10)] == ["poison"]  # delivery 1
    for n, consumer in enumerate(["w2", "w3"], start=2):  # each "dies" without acking
        got = make_queue(r, consumer).fetch(1, block_ms=10)
        assert [j.request_id for _, j in got] == ["poison"], f"delivery {n} not reclaimed"
    last = make_queue(r, "w4", on_dead=lambda rid, addr, why: dead.append((rid, why)))
    assert last.fetch(1, block_ms=10) == []  # delivery 4 > max_deliveries: not handed out again
    assert [rid for rid, _ in dead] == ["poison"]
    assert r.xlen(keys.dead_letter_stream(MODEL)) == 1
    assert r.xpending(keys.prefill_stream(MODEL), keys.PREFILL_GROUP)["pending"] == 0


def test_malformed_job_goes_straight_to_dead_letter(r):
    q = make_queue(r, "w", idle_ms=60_000)
    r.xadd(keys.prefill_stream(MODEL), {keys.JOB_FIELD: b"\x93not a job"})
    r.xadd(keys.prefill_stream(MODEL), {keys.JOB_FIELD: encode(make_job("good"))})
    assert [j.request_id for _, j in q.fetch(5, block_ms=10)] == ["good"]
    entries = r.xrange(keys.dead_letter_stream(MODEL))
    assert len(entries) == 1 and b"malformed" in entries[0][1][b"reason"]


def test_group_is_recreated_after_redis_loses_it(r):
    q = make_queue(r, "w", idle_ms=60_000)
    r.flushall()  # as after a Redis restart without persistence
    assert q.fetch(1, block_ms=10) == []
    r.xadd(keys.prefill_stream(MODEL), {keys.JOB_FIELD: encode(make_job("after"))})
    assert [j.request_id for _, j in q.fetch(1, block_ms=10)] == ["after"]


def test_a_job_kept_by_its_worker_is_not_reclaimed_however_long_it_runs(r):
    """A unified worker generating for longer than reclaim_idle_ms: without ``keep`` its job is taken by
    XAUTOCLAIM (a peer's, or its own), a delivery counted each time, so a crash later dead-lettered it
    instead of letting the restarted worker resume it."""
    r.xadd(keys.prefill_stream(MODEL), {keys.JOB_FIELD: encode(make_job("long"))})
    a, b = make_queue(r, "a", idle_ms=1000), make_queue(r, "b", idle_ms=1000)
    ((entry_id, _),) = a.fetch(1, block_ms=10)
    for _ in range(4):  # 1.6 s in all: past reclaim_idle_ms, though never idle that long at once
        time.sleep(0.4)
        a.keep([entry_id])
        b._last_reclaim = 0.0
        assert b.fetch(1, block_ms=0) == []
    (pending,) = r.xpending_range(keys.prefill_stream(MODEL), keys.PREFILL_GROUP, min=entry_id, max=entry_id,
                                  count=1)
    assert pending["consumer"] == b"a" and pending["times_delivered"] == 1
