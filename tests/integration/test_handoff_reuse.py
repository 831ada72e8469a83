"""A decode worker that already holds a prompt's leading KV blocks (an earlier handoff of the same prompt, cached
by its engine) grants only the rest (HandoffGrant.cached_blocks), and the sender sends the prompt's blocks from
there; a reuse the header's prompt does not match is refused. Real ZMQ, real HandoffManager and HandoffReceiver
(tests/integration/handoff_harness.py)."""

import torch

from kvrelay.prefill_worker import handoff
from kvrelay.prefill_worker.handoff import FirstToken, State
from kvrelay.shared.engine.request import Request
from kvrelay.shared.handoff import outbound
from kvrelay.shared.handoff.blocks import frame_nbytes
from kvrelay.shared.wire.block_hash import block_hash_chain, cache_namespace
from kvrelay.shared.wire.sampling_params import SamplingParams
from tests.integration.handoff_harness import BLOCK, MODEL, SHAPE, early, hand_off_tiny, poll_until, wait_for

NUM_TOKENS = 5 * BLOCK + 3  # six blocks: five full ones may be reused, the last (partial) one is always sent


def cache_on_decode_side(side, rid: str, tokens: list[int]) -> None:
    """What the decode engine does once a handed-off request runs (scheduler -> cache_blocks), then the request
    ends: its full blocks stay cached, evictable."""
    side.pause()
    try:
        blocks = side.rt.core.kv._blocks  # the engine's block manager: here no engine runs the request
        req = Request(rid, tokens, SamplingParams(), tenant="bench")  # synthetic_job's tenant
        req.num_computed_tokens = len(tokens)
        blocks.cache_blocks(req, len(tokens))
        side.rt.core.kv.free(rid)
    finally:
        side.paused.clear()


def first_handoff(rt, side, manager) -> list[int]:
    t, _ = hand_off_tiny(manager, rt, "first", NUM_TOKENS)
    assert t.state is State.DONE and t.grant.cached_blocks == 0, t.reason
    wait_for(lambda: "first" in side.admitted, "admission")
    held = side.blocks("first")
    cache_on_decode_side(side, "first", [1] * NUM_TOKENS)
    return held


def test_a_prompt_held_on_the_decode_side_is_granted_and_sent_past_its_cached_blocks(prefill, decode_side):
    rt, make = prefill
    side = decode_side(prefix_caching=True)
    manager = make(side.addr)
    held = first_handoff(rt, side, manager)
    kv_before = side.rt.core.kv.kv_cache.clone()
    free = rt.core.kv.num_free_blocks

    t, src = hand_off_tiny(manager, rt, "second", NUM_TOKENS)
    assert t.state is State.DONE and t.transport == "layers", t.reason
    wait_for(lambda: "second" in side.admitted, "admission")
    dst = side.blocks("second")
    assert t.grant.cached_blocks == 5 and t.grant.block_ids == dst[5:] and dst[:5] == held[:5]
    assert side.admitted["second"].cached_blocks == 5 and side.admitted["second"].num_blocks == 1
    cache = side.rt.core.kv.kv_cache
    assert torch.equal(cache[:, :, dst[5:]], rt.core.kv.kv_cache[:, :, src[5:]])  # the prompt's block 5, not 0
    assert not torch.equal(cache[:, :, dst[5:]], rt.core.kv.kv_cache[:, :, src[:1]])
    assert torch.equal(cache[:, :, held[:5]], kv_before[:, :, held[:5]])  # the reused blocks: untouched
    assert t.nbytes == frame_nbytes(cache, 1) * SHAPE[0]  # one block's KV moved, of six
    assert rt.core.kv.num_free_blocks == free  # our blocks went back


def test_layers_streamed_into_a_grant_past_cached_blocks_come_from_the_prompt_s_later_blocks(prefill, decode_side):
    rt, make = prefill
    side = decode_side(prefix_caching=True)
    manager = make(side.addr)
    first_handoff(rt, side, manager)
    kv = rt.core.kv.kv_cache
    final = kv.clone()
    src = rt.core.kv.reserve("s", NUM_TOKENS)
    kv[:, :, src] = 0  # not computed yet
    t = early(manager, "s", NUM_TOKENS)
    poll_until(manager, lambda: t.state is State.GRANTED, "the early grant")
    assert t.grant.cached_blocks == 5 and len(t.grant.block_ids) == 1
    stream = manager.stream_for(MODEL)
    assert stream.begin([("s", src)]) and t.state is State.STREAMING
    for layer in range(SHAPE[0]):  # the forward
        kv[layer, :, src] = final[layer, :, src]
        stream.layer_done(layer)
    stream.end()
    assert manager.complete("s", FirstToken(7))
    ended = poll_until(manager, lambda: "s" not in manager.transfers, "the ack")
    assert [e.state for e in ended] == [State.DONE] and ended[0].streamed
    wait_for(lambda: "s" in side.admitted, "admission")
    dst = side.blocks("s")
    assert torch.equal(side.rt.core.kv.kv_cache[:, :, dst[5:]], final[:, :, src[5:]])


def test_a_reuse_the_header_s_prompt_does_not_match_is_refused_and_its_blocks_freed(prefill, decode_side,
                                                                                      monkeypatch):
    """The reused blocks were matched by 64-bit hashes only: an asker offering another prompt's hashes (forged,
    or a collision) gets them granted, but the header's prompt is compared with what they hold, and the transfer
    fails before any wrong KV is admitted."""
    rt, make = prefill
    side = decode_side(prefix_caching=True)
    manager = make(side.addr)
    other = [2] * NUM_TOKENS
    side.rt.core.kv.reserve("other", NUM_TOKENS)
    cache_on_decode_side(side, "other", other)
    free = side.rt.core.kv.num_free_blocks
    forged = block_hash_chain(other, BLOCK, cache_namespace("bench", None), 64)
    for where in (outbound, handoff):  # the job's prompt is [1] * NUM_TOKENS; the pick works the hashes out first
        monkeypatch.setattr(where, "offered_hashes", lambda t, kv: forged)

    t, _ = hand_off_tiny(manager, rt, "forged", NUM_TOKENS)
    assert t.state is State.FAILED and "another prompt's" in t.reason, t.reason  # the decode side's nack
    assert "forged" not in side.admitted
    wait_for(lambda: side.rt.core.kv.num_free_blocks == free and not side.blocks("forged"), "the blocks freed")
