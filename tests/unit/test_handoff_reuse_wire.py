"""The wire of decode-side KV reuse: an ask's block hashes are ignorable (an older decode worker grants every
block), a grant's cached_blocks must be understood, and the header that ends a transfer into a grant past cached
blocks is checked against what those blocks hold (shared/handoff/incoming.py ``check_header``)."""

import dataclasses
import time

import msgpack
import pytest
import torch

from kvrelay.shared.engine import detached_kv
from kvrelay.shared.engine.request import Request
from kvrelay.shared.handoff.blocks import frame_nbytes, layout_of
from kvrelay.shared.handoff.incoming import Incoming, check_header
from kvrelay.shared.handoff.outbound import offered_hashes
from kvrelay.shared.handoff.standalone import synthetic_job
from kvrelay.shared.handoff.transfer import Transfer
from kvrelay.shared.wire import codec
from kvrelay.shared.wire import handoff as h
from kvrelay.shared.wire.block_hash import block_hash_chain, cache_namespace
from kvrelay.shared.wire.sampling_params import SamplingParams

BS = 4


def test_block_hashes_are_ignorable_and_cached_blocks_must_be_understood():
    ask = h.HandoffRequest("r", "m", num_tokens=10, block_size=BS, block_hashes=[1, 2**64 - 1])
    raw = msgpack.unpackb(codec.encode(ask), raw=False)
    assert raw[codec.IGNORABLE_KEY] == ["block_hashes"] and codec.decode(codec.encode(ask), h.HandoffRequest) == ask
    grant = h.HandoffGrant("r", accepted=True, block_ids=[7], epoch=1, cached_blocks=2)
    raw = msgpack.unpackb(codec.encode(grant), raw=False)
    assert raw["cached_blocks"] == 2 and codec.IGNORABLE_KEY not in raw
    assert codec.decode(codec.encode(grant), h.HandoffGrant).cached_blocks == 2
    assert "cached_blocks" not in msgpack.unpackb(codec.encode(dataclasses.replace(grant, cached_blocks=0)), raw=False)


@pytest.mark.parametrize("hashes", [[1, 2, 3], [-1]])
def test_an_ask_offers_no_more_hashes_than_its_prompt_has_full_blocks(hashes):
    ask = h.HandoffRequest("r", "m", num_tokens=10, block_size=BS, block_hashes=hashes)  # two full blocks
    with pytest.raises(ValueError, match="block_hashes"):
        codec.decode(codec.encode(ask), h.HandoffRequest)


def test_a_grant_reuses_blocks_only_with_some_to_fill():
    with pytest.raises(ValueError, match="cached_blocks"):
        codec.decode(codec.encode(h.HandoffGrant("r", accepted=True, block_ids=[], cached_blocks=2)), h.HandoffGrant)


def test_the_sender_offers_its_prompt_s_full_blocks_hashed_as_block_managers_hash_them():
    kv = detached_kv(torch.zeros(1, 2, 8, BS, 1, 2))
    job = dataclasses.replace(synthetic_job("r", 11, "m"), prompt_token_ids=list(range(11)), cache_salt="s")
    hashes = offered_hashes(Transfer(job=job, entry_id=b"r"), kv)
    assert hashes == block_hash_chain(list(range(11)), BS, cache_namespace("bench", "s"), 99) and len(hashes) == 2
    req = Request("r", list(range(11)), SamplingParams(), cache_salt="s", tenant="bench")
    assert kv._blocks._hashes(req, 2) == hashes  # the decode side's block manager's own chain


def test_a_prompt_its_prefill_hashed_already_is_not_hashed_again(monkeypatch):
    """The prefill engine's prefix cache hashed the prompt's blocks as it computed them: the offer takes that chain
    (hashing costs the prefill loop a few microseconds a block); one it has not hashed in full is hashed here from
    where that chain ends."""
    from kvrelay.shared.handoff import outbound

    kv = detached_kv(torch.zeros(1, 2, 8, BS, 1, 2))
    job = dataclasses.replace(synthetic_job("r", 11, "m"), prompt_token_ids=list(range(11)), cache_salt="s")
    want = block_hash_chain(list(range(11)), BS, cache_namespace("bench", "s"), 99)
    req = Request("r", list(range(11)), SamplingParams(), cache_salt="s", tenant="bench")
    kv._blocks._hashes(req, 1)  # a chunk's worth: one block of two
    calls = []
    monkeypatch.setattr(outbound, "block_hash_chain", lambda *a: calls.append(a) or block_hash_chain(*a))
    assert offered_hashes(Transfer(job=job, entry_id=b"r"), kv) == want and len(calls) == 1
    assert calls[0][4] == want[:1]  # the prefill's block is not hashed again
    kv._blocks._hashes(req, 2)  # the whole prompt computed
    assert offered_hashes(Transfer(job=job, entry_id=b"r"), kv) == want and len(calls) == 1


def _cached(kv, tokens: list[int], tenant: str = "bench") -> list[int]:
    kv.reserve("old", len(tokens))
    req = Request("old", tokens, SamplingParams(), tenant=tenant)
    req.num_computed_tokens = len(tokens)
    kv._blocks.cache_blocks(req, len(tokens))  # what the decode engine does once a handed-off request runs
    blocks = kv.block_ids("old")
    kv.free("old")
    return blocks


def _transfer_into(kv, tokens: list[int], job_tokens: list[int], tenant: str = "bench", cached_blocks=None):
    """An arriving transfer into a reservation reusing ``tokens``' cached blocks, and its header for a job of
    ``job_tokens`` and ``tenant``."""
    hashes = block_hash_chain(tokens, BS, cache_namespace("bench", None), 99)
    blocks, cached = kv.reserve_prefix("new", len(job_tokens), hashes)
    now = time.monotonic()
    inc = Incoming(b"p", "p1", "m", blocks[cached:], len(job_tokens), "layers", receiver=None, ttl_s=5.0,
                   deadline=now + 5, since=now, epoch=1, reused=blocks[:cached])
    job = dataclasses.replace(synthetic_job("new", len(job_tokens), "m"), prompt_token_ids=job_tokens, tenant=tenant)
    header = h.KVHeader(job=job, **layout_of(kv.kv_cache), num_blocks=len(blocks) - cached, block_ids=blocks[cached:],
                        transport="layers", nbytes=frame_nbytes(kv.kv_cache, len(blocks) - cached), first_token_id=1, first_logprob=None, first_top_logprobs=None,
                        prompt_logprobs=None, num_cached_tokens=0, epoch=1,
                        cached_blocks=cached if cached_blocks is None else cached_blocks)
    return inc, header, cached


def test_a_header_whose_prompt_the_reused_blocks_hold_is_taken():
    kv = detached_kv(torch.zeros(1, 2, 16, BS, 1, 2), prefix_caching=True)
    prompt = list(range(13))
    _cached(kv, prompt)
    inc, header, cached = _transfer_into(kv, prompt, prompt)
    assert cached == 3
    check_header(header, [], inc, kv)


@pytest.mark.parametrize("case", ["tokens", "tenant", "count"])
def test_a_header_the_reused_blocks_do_not_match_is_refused(case):
    kv = detached_kv(torch.zeros(1, 2, 16, BS, 1, 2), prefix_caching=True)
    prompt = list(range(13))
    _cached(kv, prompt)
    job_tokens = prompt[:9] + [0] * 4 if case == "tokens" else prompt  # "tokens": the third block differs
    inc, header, cached = _transfer_into(kv, prompt, job_tokens, tenant="acme" if case == "tenant" else "bench",
                                         cached_blocks=2 if case == "count" else None)
    assert cached == 3
    with pytest.raises(ValueError, match="another prompt's" if case != "count" else "held here"):
        check_header(header, [], inc, kv)
