"""Handoff seats over real ZMQ sockets: a grant asked for early (while the prompt computes) is cancelled or
parked, never left to expire on the decode side; a computed handoff refused for lack of room keeps its KV and
asks again until its job's deadline. The sides are tests/integration/handoff_harness.py's, as in
tests/integration/test_handoff.py."""

import dataclasses
import time

import torch

from kvrelay.prefill_worker.handoff import FirstToken, State
from kvrelay.shared.handoff.standalone import synthetic_job
from tests.integration.handoff_harness import BLOCK, MODEL, early, poll_until, wait_for


def test_early_grants_are_cancelled_or_parked_never_left_to_expire(prefill, decode_side):
    """A prompt that ends at its first token, or one aborted mid-stream, cancels its grant (the decode
    side frees the blocks at once); one refused early, or whose grant went stale while it waited, asks
    again once computed and lands."""
    rt, make = prefill
    side = decode_side(ttl_s=1.0)
    manager = make(side.addr)
    kv = side.rt.core.kv
    total = kv.num_free_blocks
    t = early(manager, "eos", 4 * BLOCK)
    poll_until(manager, lambda: t.state is State.GRANTED, "a grant")
    assert kv.num_free_blocks == total - 4
    manager.cancel("eos")  # it ended at its first token
    wait_for(lambda: kv.num_free_blocks == total, "the cancelled grant's blocks")

    src = rt.core.kv.reserve("aborted", 40 * BLOCK)
    t = early(manager, "aborted", 40 * BLOCK)
    poll_until(manager, lambda: t.state is State.GRANTED, "a grant")
    stream = manager.stream_for(MODEL)
    assert stream.begin([("aborted", src)])
    stream.layer_done(t.sender.per_message - 1)  # the first group of layers is written
    poll_until(manager, lambda: "aborted" in side.receiver.incoming, "the first streamed layers")
    assert t.sender.sent == 1
    stream.end()
    manager.cancel("aborted")  # the client went away: the half-received KV is dropped
    wait_for(lambda: kv.num_free_blocks == total and not side.receiver.incoming, "the dropped transfer")
    rt.core.kv.free("aborted")

    hog = kv.reserve("hog", (total - 2) * BLOCK)  # the decode side is nearly full
    src = rt.core.kv.reserve("refused", 4 * BLOCK)
    t = early(manager, "refused", 4 * BLOCK)
    poll_until(manager, lambda: t.state is State.PARKED, "the refusal")
    kv.free("hog")
    assert hog
    stale = early(manager, "stale", 4 * BLOCK)
    stale_src = rt.core.kv.reserve("stale", 4 * BLOCK)
    poll_until(manager, lambda: stale.state is State.GRANTED, "a grant")
    time.sleep(0.6)  # half the grant's TTL: the prompt is still queued, so the grant goes back
    poll_until(manager, lambda: stale.state is State.PARKED, "the stale grant cancelled")
    wait_for(lambda: kv.num_free_blocks == total, "the stale grant's blocks")
    for rid in ("refused", "stale"):
        assert manager.complete(rid, FirstToken(3))
    ended = poll_until(manager, lambda: not manager.transfers, "both handoffs")
    assert sorted((e.job.request_id, e.state, e.streamed) for e in ended) == [
        ("refused", State.DONE, False), ("stale", State.DONE, False)]
    wait_for(lambda: {"refused", "stale"} <= set(side.admitted), "admission")
    for rid, blocks in (("refused", src), ("stale", stale_src)):
        assert torch.equal(side.rt.core.kv.kv_cache[:, :, side.blocks(rid)], rt.core.kv.kv_cache[:, :, blocks])


def test_a_prefilled_handoff_waits_for_room_past_the_handoff_timeout(prefill, decode_side):
    """A full decode side (no free blocks, a full batch) is load, not failure: a computed handoff refused
    for lack of room keeps its KV and asks again until its job's deadline, then lands once room is free."""
    rt, make = prefill
    side = decode_side()
    manager = make(side.addr, timeout_s=0.5)
    kv = side.rt.core.kv
    total = kv.num_free_blocks
    kv.reserve("hog", (total - 2) * BLOCK)  # too full for the prompt's 4 blocks
    src = rt.core.kv.reserve("waits", 4 * BLOCK)
    t = manager.start(synthetic_job("waits", 4 * BLOCK, MODEL), b"waits", FirstToken(3))
    ended: list = []
    until = time.monotonic() + 2.0  # four handoff timeouts
    while time.monotonic() < until:
        ended += manager.poll(20)
    assert ended == [] and t.state not in (State.DONE, State.FAILED) and t.waits_for_room
    assert manager.waiting_for_seat(MODEL) == 1  # what kvrelay_handoff_waiting_for_seat shows
    kv.free("hog")
    ended += poll_until(manager, lambda: not manager.transfers, "the handoff")
    assert [(e.job.request_id, e.state) for e in ended] == [("waits", State.DONE)]
    assert ended[0].seat_wait_s >= 2.0  # what kvrelay_handoff_seat_wait_seconds records
    wait_for(lambda: "waits" in side.admitted, "admission")
    assert torch.equal(side.rt.core.kv.kv_cache[:, :, side.blocks("waits")], rt.core.kv.kv_cache[:, :, src])


def test_a_handoff_waiting_for_room_fails_at_its_jobs_deadline(prefill, decode_side):
    rt, make = prefill
    side = decode_side()
    manager = make(side.addr, timeout_s=0.3)
    kv = side.rt.core.kv
    kv.reserve("hog", (kv.num_free_blocks - 2) * BLOCK)
    rt.core.kv.reserve("late", 4 * BLOCK)
    job = dataclasses.replace(synthetic_job("late", 4 * BLOCK, MODEL), deadline=time.time() + 1.0)
    manager.start(job, b"late", FirstToken(3))
    ended = poll_until(manager, lambda: not manager.transfers, "the deadline")
    assert [(e.job.request_id, e.state) for e in ended] == [("late", State.FAILED)]
    assert "no free KV blocks" in ended[0].reason
    assert time.time() >= job.deadline
    kv.free("hog")


def test_a_handoff_over_its_tenants_decode_quota_waits_apart_from_seat_waits_then_lands(prefill, decode_side):
    """The decode side holds --tenant-kv-quota (decode_worker/tenant_quota.py): a computed handoff of a tenant whose
    grants there already fill its share is answered "over quota", keeps its KV and asks again, counted as a quota
    wait rather than a seat wait, and lands once the tenant's grant there is given back."""
    rt, make = prefill
    side = decode_side(ttl_s=30.0)  # the holder's early grant stays fresh, however slow the box
    side.rt.core.tenant_kv_quota = 0.1  # of 96 blocks: 9.6
    manager = make(side.addr, timeout_s=0.5)
    holder = early(manager, "holder", 8 * BLOCK)  # the tenant's grant: 8 blocks
    poll_until(manager, lambda: holder.state is State.GRANTED, "the holder's grant")
    src = rt.core.kv.reserve("waits", 4 * BLOCK)
    t = manager.start(synthetic_job("waits", 4 * BLOCK, MODEL), b"waits", FirstToken(3))
    ended = poll_until(manager, lambda: t.seat_wait_from, "the refusal")
    assert ended == [] and t.waits_for_room and t.waits_for_quota
    assert (manager.waiting_for_seat(MODEL, over_quota=True), manager.waiting_for_seat(MODEL)) == (1, 0)
    assert side.receiver.quota.waiting(MODEL) == 1
    manager.cancel("holder")
    ended = poll_until(manager, lambda: not manager.transfers, "the handoff")
    assert [(e.job.request_id, e.state) for e in ended] == [("waits", State.DONE)]
    wait_for(lambda: "waits" in side.admitted, "admission")
    assert torch.equal(side.rt.core.kv.kv_cache[:, :, side.blocks("waits")], rt.core.kv.kv_cache[:, :, src])


def test_a_handoff_waiting_for_its_tenants_quota_fails_at_its_jobs_deadline_saying_so(prefill, decode_side):
    rt, make = prefill
    side = decode_side(ttl_s=30.0)  # the holder's early grant stays fresh, however slow the box
    side.rt.core.tenant_kv_quota = 0.1
    manager = make(side.addr, timeout_s=0.3)
    holder = early(manager, "holder", 8 * BLOCK)
    poll_until(manager, lambda: holder.state is State.GRANTED, "the holder's grant")
    rt.core.kv.reserve("late", 4 * BLOCK)
    job = dataclasses.replace(synthetic_job("late", 4 * BLOCK, MODEL), deadline=time.time() + 1.0)
    manager.start(job, b"late", FirstToken(3))
    ended = poll_until(manager, lambda: "late" not in manager.transfers, "the deadline")
    assert [(e.job.request_id, e.state) for e in ended] == [("late", State.FAILED)]
    assert "tenant 'bench' holds 8 KV blocks here and this request needs 4 more, past its --tenant-kv-quota 0.1" in \
        ended[0].reason
    assert time.time() >= job.deadline
    manager.cancel("holder")
