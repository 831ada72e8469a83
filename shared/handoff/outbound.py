"""What the prefill side sends for one transfer (sender.py's state machine decides when): the ask, the
``KVSender`` that moves the KV into the grant through the first transport able to serve it, and the header
that follows the KV. Each is built from the engine's KV (``EngineCore.kv``) and the transfer alone."""

import time
from collections.abc import Callable

from kvrelay.shared.engine.kv_connector import EngineKV
from kvrelay.shared.handoff.base import KVSender, Transport
from kvrelay.shared.handoff.blocks import DTYPE_NAMES, layout_of
from kvrelay.shared.handoff.rank_parts import RankPartsSender
from kvrelay.shared.handoff.sharded import exported, frames_only
from kvrelay.shared.handoff.transfer import Transfer
from kvrelay.shared.wire.block_hash import block_hash_chain, cache_namespace
from kvrelay.shared.wire.handoff import MAX_BLOCK_HASHES, HandoffRequest, KVHeader


def request_for(t: Transfer, kv: EngineKV, transports: list[Transport], requester: str,
                hold_s: float) -> HandoffRequest:
    """``t``'s request for blocks, saying where its KV could be written directly from (none for a sharded
    worker: its KV leaves through frames only)."""
    transports = frames_only(transports) if kv.sharded else transports
    locality = next((place for tr in transports if (place := tr.locality(kv.kv_cache))), "")
    if t.block_hashes is None:
        t.block_hashes = offered_hashes(t, kv)
    return HandoffRequest(request_id=t.job.request_id, model=t.job.model, num_tokens=len(t.job.prompt_token_ids),
                          block_size=kv.block_size, kv_dtype=DTYPE_NAMES[kv.kv_cache.dtype], device_uuid=locality,
                          requester=requester, hold_s=hold_s, kv_scales=kv.scales_digest, ask=t.ask,
                          tenant=t.job.tenant, early=not t.computed, block_hashes=t.block_hashes,
                          reply_addr=t.job.reply_addr)


def offered_hashes(t: Transfer, kv: EngineKV) -> list[int]:
    """The hash chain of ``t``'s prompt's full blocks, hashed as every block manager hashes them, so the decode
    worker can reuse those it holds. None from a sharded worker: its KV leaves by ranks and parts, a path kept
    whole, every block sent."""
    if kv.sharded:
        return []
    job = t.job
    full = min(len(job.prompt_token_ids) // kv.block_size, MAX_BLOCK_HASHES)
    known = kv.prompt_hashes(job.request_id)  # its prefill hashed them for its own cache, in the same namespace
    if len(known) >= full:
        return known[:full]
    # what its prefill has not hashed: all of it with prefix caching off; the last block of a prompt that ends on a
    # block boundary (the prefill keeps one token to compute)
    return block_hash_chain(job.prompt_token_ids, kv.block_size, cache_namespace(job.tenant, job.cache_salt),
                            MAX_BLOCK_HASHES, known)


def source_blocks(t: Transfer, blocks: list[int]) -> list[int] | str:
    """Our blocks of ``blocks`` (the prompt's) that fill ``t``'s grant: those past the ones the decode worker holds
    already (HandoffGrant.cached_blocks), one per granted block; or why the grant cannot be served."""
    grant, cached = t.grant, t.grant.cached_blocks
    if cached > len(t.block_hashes or ()):
        return f"the grant reuses {cached} blocks, {len(t.block_hashes or ())} were offered"
    src = blocks[cached:cached + len(grant.block_ids)]
    if len(src) != len(grant.block_ids):
        return f"grant has {cached} held and {len(grant.block_ids)} new blocks, the prompt uses {len(blocks)}"
    return src


def sender_for(t: Transfer, engine_kv: EngineKV, transports: list[Transport], src_blocks: list[int],
               requester: str, timeout_s: float, deferred: bool, wake: Callable[..., None]) -> KVSender | None:
    """The sender of ``src_blocks`` into ``t``'s grant (with ``deferred``, layer by layer as the forward writes
    them); None when no transport can serve the grant."""
    if engine_kv.sends_parts_to(t.grant.targets):
        # each rank sends its own layers and heads (one process: each decode rank its share); we keep the control
        return RankPartsSender(engine_kv, t.job.request_id, src_blocks, t.target, requester, timeout_s, t.grant)
    kv = engine_kv.kv_cache
    if engine_kv.sharded:  # no links for its ranks: every rank's part gathered into one full-head copy
        (kv, src_blocks), transports = exported(engine_kv, src_blocks), frames_only(transports)
    age = time.monotonic() - t.asked_at
    return next((s for transport in transports
                 if (s := transport.sender(t.job.model, kv, src_blocks, t.grant, t.target, age, deferred, wake))), None)


def header_for(t: Transfer, kv: EngineKV) -> KVHeader:
    """The last message of ``t``'s KV, carrying its first token and its grant's blocks and epoch."""
    first, grant = t.first, t.grant
    return KVHeader(
        job=t.job, **layout_of(kv.kv_cache, kv.num_kv_heads, kv.num_layers), transport=t.transport,
        num_blocks=len(grant.block_ids), block_ids=grant.block_ids, nbytes=t.nbytes, first_token_id=first.token_id,
        first_logprob=first.logprob, first_top_logprobs=first.top_logprobs, prompt_logprobs=None,
        num_cached_tokens=first.num_cached_tokens, epoch=grant.epoch, cached_blocks=grant.cached_blocks,
    )
