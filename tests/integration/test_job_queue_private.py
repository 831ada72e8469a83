"""Private (prefix-affinity) job streams against a real Redis: a worker reads its own stream before the
shared one, peers adopt a dead worker's stream (undelivered and pending jobs alike) and a stalled one's
undelivered jobs (each by one peer only) but leave a stepping one's alone, delivery counting still
dead-letters poison, and a hand-back moves private jobs to the shared stream where a peer takes them."""

import asyncio
import logging
import threading
import time

import pytest

from kvrelay.shared.wire import job_adoption, job_queue
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.protocol import WorkerInfo
from kvrelay.shared.wire.redis_conn import sync_client
from tests.integration.job_queue_harness import MODEL, make_job, make_queue

SHARED = keys.prefill_stream(MODEL)
STALLED_AFTER_S = 30.0


def private(worker: str) -> str:
    return keys.prefill_worker_stream(MODEL, worker)


def put(r, stream: str, rid: str) -> None:
    r.xadd(stream, {keys.JOB_FIELD: encode(make_job(rid))})


@pytest.fixture()
def r(redis_url):
    client = sync_client(redis_url)
    client.flushall()
    return client


def ids(got) -> list[str]:
    return [job.request_id for _, job in got]


def test_private_jobs_come_first_and_count_spans_both_streams(r):
    q = make_queue(r, "a", idle_ms=60_000)
    put(r, SHARED, "s0")
    put(r, private("a"), "p0")
    put(r, private("a"), "p1")
    assert ids(q.fetch(2, block_ms=0)) == ["p0", "p1"]
    assert ids(q.fetch(5, block_ms=0)) == ["s0"]


def test_one_blocking_read_wakes_for_either_stream(r):
    q = make_queue(r, "a", idle_ms=60_000)
    q.fetch(1, block_ms=0)  # the reclaim/adopt passes are done; the next fetch goes straight to the read
    for stream, rid in ((private("a"), "p"), (SHARED, "s")):
        timer = threading.Timer(0.2, put, (r, stream, rid))
        timer.start()
        assert ids(q.fetch(4, block_ms=10_000)) == [rid]
        timer.join()


def test_a_busy_read_of_both_streams_is_one_round_trip(r, monkeypatch):
    """A busy worker reads its streams every engine step: one command for both, not one per stream, and
    still exactly ``count`` jobs, private first."""
    q = make_queue(r, "a", idle_ms=60_000)
    q.fetch(1, block_ms=0)  # the reclaim/adopt passes are done; the next fetches go straight to the read
    put(r, private("a"), "p0")
    put(r, SHARED, "s0")
    put(r, SHARED, "s1")
    sent = []
    execute = r.execute_command
    monkeypatch.setattr(r, "execute_command", lambda *args, **kw: sent.append(args[0]) or execute(*args, **kw))
    assert ids(q.fetch(2, block_ms=0)) == ["p0", "s0"]
    assert len(sent) == 1
    assert r.xpending(SHARED, keys.PREFILL_GROUP)["pending"] == 1  # s1 was not delivered beyond count
    assert ids(q.fetch(4, block_ms=0)) == ["s1"]
    assert q.fetch(4, block_ms=0) == []
    assert len(sent) - sent.count("XPENDING") == 3  # the test's own XPENDING aside


def test_a_surplus_job_is_kept_from_reclaim_until_served(r):
    """Both streams answering one blocking read deliver more than asked for; what waits for room is ours, so a
    peer's reclaim must not take it while we still mean to run it."""
    r.set(keys.worker_key("a"), b"alive")  # a live peer's private stream is left alone
    q = make_queue(r, "a", idle_ms=100)
    q.fetch(1, block_ms=0)
    put(r, private("a"), "p0")
    put(r, SHARED, "s0")
    running = q.fetch(1, block_ms=1000)  # the idle worker's blocking read, over both streams
    assert ids(running) == ["p0"]  # s0 delivered too, held back as surplus
    time.sleep(0.2)
    q.keep([entry for entry, _ in running])
    peer = make_queue(r, "b", idle_ms=100)
    assert peer.fetch(4, block_ms=0) == []
    assert ids(q.fetch(4, block_ms=0)) == ["s0"]


def test_acked_private_jobs_leave_the_stream(r):
    q = make_queue(r, "a", idle_ms=60_000)
    put(r, private("a"), "p0")
    (entry, _), = q.fetch(1, block_ms=0)
    q.ack(entry)
    assert r.xlen(private("a")) == 0
    assert r.xpending(private("a"), keys.PREFILL_GROUP)["pending"] == 0


def test_a_dead_workers_private_jobs_are_adopted_pending_and_undelivered(r):
    dead = make_queue(r, "dead", idle_ms=60_000)
    for rid in ("p0", "p1", "p2"):
        put(r, private("dead"), rid)
    assert ids(dead.fetch(1, block_ms=0)) == ["p0"]  # in progress when it dies; p1, p2 never delivered
    r.set(keys.worker_key("dead"), b"alive")
    peer = make_queue(r, "peer")
    assert peer.fetch(10, block_ms=0) == []  # a live worker's private stream is its own
    r.delete(keys.worker_key("dead"))  # heartbeat gone
    peer._last_adopt = 0.0
    got = peer.fetch(10, block_ms=0)
    assert sorted(ids(got)) == ["p0", "p1", "p2"]
    peer.ack(*(entry for entry, _ in got))
    assert r.xlen(private("dead")) == 0


def test_poison_in_a_private_stream_is_dead_lettered_after_max_deliveries(r):
    dead_jobs = []
    put(r, private("w1"), "poison")
    assert ids(make_queue(r, "w1").fetch(1, block_ms=0)) == ["poison"]  # delivery 1, then w1 "dies"
    for n, consumer in enumerate(["w2", "w3"], start=2):  # each adopts it and dies without acking
        assert ids(make_queue(r, consumer).fetch(1, block_ms=0)) == ["poison"], f"delivery {n} not adopted"
    last = make_queue(r, "w4", on_dead=lambda rid, addr, why: dead_jobs.append(rid))
    assert last.fetch(1, block_ms=0) == []
    assert dead_jobs == ["poison"]
    assert r.xlen(keys.dead_letter_stream(MODEL)) == 1 and r.xlen(private("w1")) == 0


def test_hand_back_moves_private_jobs_to_the_shared_stream(r):
    draining = make_queue(r, "a", idle_ms=60_000)
    peer = make_queue(r, "b", idle_ms=60_000)
    peer.fetch(1, block_ms=0)  # b's first adopt pass: a is alive (its private stream is not b's)
    r.set(keys.worker_key("a"), b"alive")
    for rid in ("p0", "p1"):
        put(r, private("a"), rid)
    taken = draining.fetch(1, block_ms=0)
    assert ids(taken) == ["p0"]
    draining.hand_back([entry for entry, _ in taken])  # p0 in progress, p1 still undelivered
    assert r.xlen(private("a")) == 0
    assert r.xpending(private("a"), keys.PREFILL_GROUP)["pending"] == 0
    got = peer.fetch(5, block_ms=0)
    assert sorted(ids(got)) == ["p0", "p1"]
    prior = {job.request_id: int(fields_prior) for (_, job), fields_prior in zip(
        got, (r.xrange(SHARED, min=e, max=e)[0][1][job_queue.PRIOR_FIELD] for e, _ in got), strict=True)}
    assert prior == {"p0": 1, "p1": 0}  # the real delivery still counts; the move's read does not


def test_a_long_gone_peers_empty_stream_and_consumer_are_forgotten(r, monkeypatch):
    monkeypatch.setattr(job_adoption, "FORGET_AFTER_S", -1.0)
    make_queue(r, "gone")  # registered, then died with nothing routed to it
    peer = make_queue(r, "peer")
    put(r, private("gone"), "p0")
    got = peer.fetch(5, block_ms=0)
    assert ids(got) == ["p0"] and r.exists(private("gone"))  # a job still there: not forgotten yet
    peer.ack(*(entry for entry, _ in got))
    peer._last_adopt = 0.0
    peer.fetch(5, block_ms=0)
    assert not r.exists(private("gone"))
    assert [c["name"] for c in r.xinfo_consumers(SHARED, keys.PREFILL_GROUP)] == [b"peer"]


def test_queue_gauges_and_depth_count_private_streams(r, redis_url):
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

    q = make_queue(r, "a", idle_ms=60_000)
    put(r, SHARED, "s0")
    for rid in ("p0", "p1"):
        put(r, private("a"), rid)
    snap = asyncio.run(snapshot())
    assert (snap.depth, snap.pending) == (3, 0)
    got = q.fetch(2, block_ms=0)  # p0, p1: now pending
    snap = asyncio.run(snapshot())
    assert (snap.depth, snap.pending) == (3, 2)
    q.ack(*(entry for entry, _ in got))
    snap = asyncio.run(snapshot())
    assert (snap.depth, snap.pending) == (1, 0)


def heartbeat(worker: str, step_age_s: float) -> bytes:
    """``worker``'s heartbeat record, its engine loop in one step for ``step_age_s``."""
    now = time.time()
    return encode(WorkerInfo(worker_id=worker, role="unified", models=[MODEL], zmq_addr="tcp://127.0.0.1:1",
                             free_blocks=1, total_blocks=1, running=1, waiting=0, pid=1, host="h", started=now,
                             heartbeat=now, step_age_s=step_age_s))


def stuck_with(r, pending: list[str], undelivered: list[str]):
    """A worker that read ``pending`` from its private stream, then stalled with ``undelivered`` routed to it."""
    stuck = make_queue(r, "stuck", idle_ms=60_000)
    for rid in pending:
        put(r, private("stuck"), rid)
    assert ids(stuck.fetch(len(pending), block_ms=0)) == pending
    for rid in undelivered:
        put(r, private("stuck"), rid)
    r.set(keys.worker_key("stuck"), heartbeat("stuck", 2 * STALLED_AFTER_S))
    return stuck


def pending_of(r, worker: str) -> dict[bytes, int]:
    """Consumer -> how many entries of ``worker``'s private stream it holds pending."""
    return {c["name"]: c["pending"] for c in r.xinfo_consumers(private(worker), keys.PREFILL_GROUP) if c["pending"]}


def test_a_stalled_peers_undelivered_private_jobs_are_taken_and_its_pending_ones_left(r, caplog):
    stuck = stuck_with(r, pending=["p0"], undelivered=["p1", "p2"])
    peer = make_queue(r, "peer", stalled_step_timeout_s=STALLED_AFTER_S)
    with caplog.at_level(logging.WARNING, logger=job_adoption.__name__):
        got = peer.fetch(10, block_ms=0)
        assert sorted(ids(got)) == ["p1", "p2"]
        assert pending_of(r, "stuck") == {b"stuck": 1, b"peer": 2}
        peer._last_adopt = 0.0
        assert peer.fetch(10, block_ms=0) == []  # p0 is still the stalled worker's to finish
    assert [rec.getMessage() for rec in caplog.records if "stalled" in rec.getMessage()] == [
        "peer 'stuck' is stalled (its engine has been in one step for 60 s, over --stalled-step-timeout-s 30): "
        "taking the jobs routed to it that it has not read"]
    assert stuck.fetch(10, block_ms=0) == []  # awake again: what the peer took is not delivered to it as well
    peer.ack(*(entry for entry, _ in got))
    assert r.xlen(private("stuck")) == 1


def test_a_stepping_peers_private_jobs_are_left_alone(r):
    stuck_with(r, pending=["p0"], undelivered=["p1"])
    never = make_queue(r, "never")  # --stalled-step-timeout-s 0: no worker is ever stalled
    assert never.fetch(10, block_ms=0) == []
    peer = make_queue(r, "peer", stalled_step_timeout_s=STALLED_AFTER_S)
    # in a step, but not for long; a record this worker cannot read (a newer worker's) is not judged
    for record in (heartbeat("stuck", STALLED_AFTER_S / 2), b"not a WorkerInfo"):
        r.set(keys.worker_key("stuck"), record)
        peer._last_adopt = 0.0
        assert peer.fetch(10, block_ms=0) == []
    assert pending_of(r, "stuck") == {b"stuck": 1}
    assert r.xlen(private("stuck")) == 2


def test_two_peers_never_take_the_same_job_of_a_stalled_peer(r):
    routed = [f"p{i}" for i in range(40)]
    stuck = stuck_with(r, pending=[], undelivered=routed)
    peers = [make_queue(r, name, stalled_step_timeout_s=STALLED_AFTER_S) for name in ("b", "c")]
    taken: dict[str, list[str]] = {"b": [], "c": []}
    start = threading.Barrier(len(peers))

    def adopt(peer) -> None:
        start.wait()
        while got := peer.fetch(3, block_ms=0):
            taken[peer.consumer] += ids(got)
            peer._last_adopt = 0.0

    threads = [threading.Thread(target=adopt, args=(peer,)) for peer in peers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(taken["b"] + taken["c"]) == sorted(routed)  # each once: none twice, none left
    assert stuck.fetch(10, block_ms=0) == []
