"""Priority bands in Redis (shared/wire/priority_bands.py) against a real Redis: a backlog queued where the
gateway queues a priority model's jobs is taken best band first by a worker that starts afterwards, in
arrival order within a band; private (band-0) jobs wait behind better bands only; a dead worker's pending
jobs of any band are reclaimed, a drained one's handed back, and the queue gauges count every band."""

import asyncio

import pytest

from kvrelay.shared.wire import job_adoption
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.priority_bands import band_stream, job_stream
from kvrelay.shared.wire.redis_conn import sync_client
from tests.integration.job_queue_harness import MODEL, make_job, make_queue


@pytest.fixture()
def r(redis_url):
    client = sync_client(redis_url)
    client.flushall()
    return client


def submit(r, rid: str, priority: int) -> None:
    """Queue a job as the gateway does for a model served under the priority policy."""
    r.xadd(job_stream(MODEL, priority, "priority"), {keys.JOB_FIELD: encode(make_job(rid, priority))})


def ids(got) -> list[str]:
    return [job.request_id for _, job in got]


def test_a_worker_started_after_a_backlog_takes_the_best_priority_first(r):
    for i in range(3):
        submit(r, f"low{i}", 5)
    submit(r, "default", 0)
    submit(r, "high", -1)  # queued last, while no worker reads
    q = make_queue(r, "a", idle_ms=60_000, priority_bands=True)
    assert ids(q.fetch(1, block_ms=1000)) == ["high"]  # the first, blocking read of an idle worker
    assert ids(q.fetch(2, block_ms=0)) == ["default", "low0"]
    assert ids(q.fetch(5, block_ms=1000)) == ["low1", "low2"]


def test_within_a_band_jobs_go_in_arrival_order(r):
    """Priorities past the clamp share the edge band; there arrival decides, not the value."""
    for rid, priority in (("w9", 9), ("b-1", -1), ("w3", 3), ("b-100", -100), ("w2", 2), ("b-5", -5), ("c-1", -1)):
        submit(r, rid, priority)
    q = make_queue(r, "a", idle_ms=60_000, priority_bands=True)
    got = []
    while batch := q.fetch(2, block_ms=0):
        got += ids(batch)
    assert got == ["b-100", "b-5", "b-1", "c-1", "w9", "w3", "w2"]


def test_private_jobs_wait_behind_better_bands_only(r):
    q = make_queue(r, "a", idle_ms=60_000, priority_bands=True)
    q.fetch(1, block_ms=0)  # its reclaim/adopt passes are done
    submit(r, "worse", 1)
    submit(r, "shared", 0)
    r.xadd(keys.prefill_worker_stream(MODEL, "a"), {keys.JOB_FIELD: encode(make_job("private"))})
    submit(r, "better", -1)
    assert ids(q.fetch(4, block_ms=0)) == ["better", "private", "shared", "worse"]


def test_a_dead_workers_pending_jobs_in_a_worse_band_are_redelivered(r):
    dead = make_queue(r, "dead", idle_ms=60_000, priority_bands=True)
    submit(r, "low0", 4)
    submit(r, "low1", 4)
    assert ids(dead.fetch(2, block_ms=0)) == ["low0", "low1"]  # taken, then the worker is killed: never ACKed
    low = band_stream(MODEL, 2)
    assert r.xpending(low, keys.PREFILL_GROUP)["pending"] == 2
    peer = make_queue(r, "peer", idle_ms=0, priority_bands=True)  # past the reclaim idle time at once
    got = peer.fetch(5, block_ms=0)
    assert ids(got) == ["low0", "low1"]
    pending = r.xpending_range(low, keys.PREFILL_GROUP, "-", "+", 10)
    assert {(p["consumer"], p["times_delivered"]) for p in pending} == {(b"peer", 2)}
    peer.ack(*(entry for entry, _ in got))
    assert r.xlen(low) == 0


def test_a_draining_worker_hands_a_better_bands_jobs_back_to_a_peer_at_once(r):
    draining = make_queue(r, "a", idle_ms=60_000, priority_bands=True)
    peer = make_queue(r, "b", idle_ms=60_000, priority_bands=True)  # a long idle threshold on purpose
    submit(r, "high", -2)
    taken = draining.fetch(1, block_ms=0)
    assert peer.fetch(1, block_ms=0) == []
    draining.hand_back([entry for entry, _ in taken])
    peer._last_reclaim = 0.0  # the peer's next reclaim pass (it runs one a second), without sleeping
    assert ids(peer.fetch(1, block_ms=0)) == ["high"]
    (pending,) = r.xpending_range(band_stream(MODEL, -2), keys.PREFILL_GROUP, "-", "+", 10)
    assert (pending["consumer"], pending["times_delivered"]) == (b"b", 2)


def test_a_forgotten_peer_leaves_the_band_groups_but_not_its_pending_jobs(r, monkeypatch):
    monkeypatch.setattr(job_adoption, "FORGET_AFTER_S", -1.0)
    gone = make_queue(r, "gone", idle_ms=60_000, priority_bands=True)
    submit(r, "high", -1)
    submit(r, "low", 3)
    got = gone.fetch(2, block_ms=0)  # a consumer in both bands' groups now
    assert ids(got) == ["high", "low"]
    gone.ack(got[0][0])  # then killed, low in progress
    peer = make_queue(r, "peer", idle_ms=60_000, priority_bands=True)  # low is not idle long enough to reclaim
    peer.fetch(1, block_ms=0)  # its adopt pass forgets the peer whose heartbeat is gone

    def consumers(band: int) -> set[bytes]:
        return {c["name"] for c in r.xinfo_consumers(band_stream(MODEL, band), keys.PREFILL_GROUP)}

    assert b"gone" not in consumers(0) and b"gone" not in consumers(-1)
    assert b"gone" in consumers(2)  # removing it would drop its pending job, which a reclaim still owes
    assert r.xpending(band_stream(MODEL, 2), keys.PREFILL_GROUP)["pending"] == 1


def test_a_model_switched_to_first_come_first_served_still_serves_its_band_backlog(r):
    """Jobs queued under the priority policy stay in the band streams when the model is swapped to first come,
    first served: its workers take them (no gateway adds more), not leave them to time out."""
    submit(r, "low", 3)
    submit(r, "high", -1)
    submit(r, "default", 0)
    fcfs = make_queue(r, "a", idle_ms=60_000)  # a worker of the model after the swap
    got = fcfs.fetch(5, block_ms=0)  # its first read runs the once-a-second pass that finds them
    assert sorted(ids(got)) == ["default", "high", "low"]
    fcfs.ack(*(entry for entry, _ in got))
    assert all(r.xlen(band_stream(MODEL, band)) == 0 for band in (-1, 0, 2))


def test_a_first_come_first_served_worker_reclaims_a_dead_peers_stranded_band_job(r):
    submit(r, "low", 4)
    dead = make_queue(r, "dead", idle_ms=60_000)
    assert ids(dead.fetch(1, block_ms=0)) == ["low"]  # taken, never ACKed: its worker is killed
    peer = make_queue(r, "peer", idle_ms=0)
    assert ids(peer.fetch(1, block_ms=0)) == ["low"]
    (pending,) = r.xpending_range(band_stream(MODEL, 2), keys.PREFILL_GROUP, "-", "+", 10)
    assert (pending["consumer"], pending["times_delivered"]) == (b"peer", 2)


def test_queue_gauges_count_every_band(r, redis_url):
    from kvrelay.gateway.queue_stats import QueueStats
    from kvrelay.shared.wire.redis_conn import async_client

    async def snapshot():
        client = async_client(redis_url)
        try:
            stats = QueueStats(cache_s=0.0)
            await stats.refresh(client, [MODEL])
            return stats.snapshot[MODEL]
        finally:
            await client.aclose()

    for rid, priority in (("high", -2), ("default", 0), ("low", 7)):
        submit(r, rid, priority)
    snap = asyncio.run(snapshot())  # no worker yet: no group on any stream
    assert (snap.depth, snap.pending) == (3, 0)
    q = make_queue(r, "a", idle_ms=60_000, priority_bands=True)
    got = q.fetch(1, block_ms=0)
    snap = asyncio.run(snapshot())
    assert (snap.depth, snap.pending) == (3, 1)
    q.ack(*(entry for entry, _ in got))
    snap = asyncio.run(snapshot())
    assert (snap.depth, snap.pending) == (2, 0)
