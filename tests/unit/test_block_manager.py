"""BlockManager and HostBlockPool: ref counts, prefix cache hits/misses, eviction order, atomicity."""

import pytest

import kvrelay.shared.engine.block_manager as bm_mod
from kvrelay.shared.engine.block_manager import BlockManager
from kvrelay.shared.engine.request import Request
from kvrelay.shared.engine.swap import HostBlockPool
from kvrelay.shared.wire.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(), cache_salt=salt)


def compute(bm: BlockManager, r: Request, use_cache: bool = True) -> list[int]:
    """Admit ``r`` like the scheduler does, 'compute' its whole prompt and cache the full blocks."""
    hits, n = bm.get_computed_blocks(r) if use_cache else ([], 0)
    r.num_computed_tokens = n
    assert bm.allocate_slots(r, r.num_tokens - n, hits)
    r.num_computed_tokens = r.num_tokens
    bm.cache_blocks(r, r.num_computed_tokens)
    return bm.block_ids(r.request_id)


def test_allocate_and_free_restore_counts():
    bm = BlockManager(8, BS)
    r = req("a", range(10))
    assert bm.allocate_slots(r, 10)
    assert len(bm.block_ids("a")) == 3 and len(set(bm.block_ids("a"))) == 3
    assert bm.num_free_blocks == 5 and bm.usage == pytest.approx(3 / 8)
    r.num_computed_tokens = 10
    assert bm.allocate_slots(r, 2)  # 12 tokens still fit 3 blocks
    assert len(bm.block_ids("a")) == 3
    assert bm.allocate_slots(r, 3)  # 13 tokens: a 4th block
    assert len(bm.block_ids("a")) == 4
    bm.free("a")
    bm.free("a")  # second free, and unknown ids, are no-ops
    bm.free("nope")
    assert bm.num_free_blocks == 8 and bm.usage == 0 and bm.block_ids("a") == []


def test_shared_prefix_ref_counts():
    bm = BlockManager(8, BS)
    a = compute(bm, req("a", range(9)))  # 2 full blocks cached + 1 partial
    b_req = req("b", list(range(8)) + [100, 101, 102])
    b = compute(bm, b_req)
    assert b[:2] == a[:2] and b[2] != a[2]
    assert b_req.num_computed_tokens == 11
    assert [bm.ref_cnt[x] for x in a] == [2, 2, 1]
    assert bm.num_free_blocks == 8 - 4
    bm.free("a")
    assert [bm.ref_cnt[x] for x in a] == [1, 1, 0]
    assert bm.num_free_blocks == 8 - 3  # a's shared blocks are still referenced by b
    bm.free("b")
    assert bm.num_free_blocks == 8 and bm.usage == 0


def test_prefix_hit_is_capped_and_counted():
    bm = BlockManager(8, BS)
    compute(bm, req("a", range(8)))
    bm.free("a")
    assert (bm.prefix_queries, bm.prefix_hits) == (8, 0)
    # Same 8 tokens: both blocks are cached, but one token must be left to compute.
    hits, n = bm.get_computed_blocks(req("b", range(8)))
    assert len(hits) == 1 and n == 4
    hits, n = bm.get_computed_blocks(req("c", range(9)))
    assert len(hits) == 2 and n == 8
    assert bm.prefix_queries == 8 + 8 + 9 and bm.prefix_hits == 4 + 8


def test_partial_blocks_and_diverging_prefix_miss():
    bm = BlockManager(8, BS)
    compute(bm, req("a", range(6)))  # one full block, one partial
    bm.free("a")
    assert bm.get_computed_blocks(req("b", list(range(6)) + [7, 8, 9]))[1] == 4  # partial block not cached
    # Block 1 matches a's content but its parent differs: the chain makes it a miss.
    compute(bm, req("c", range(12)))
    bm.free("c")
    assert bm.get_computed_blocks(req("d", [99, 1, 2, 3] + list(range(4, 12)) + [0]))[1] == 0


def test_hash_collision_is_a_miss(monkeypatch):
    monkeypatch.setattr(bm_mod, "hash_block_tokens", lambda parent, tokens, salt: 42)
    bm = BlockManager(8, BS)
    compute(bm, req("a", range(9)))
    bm.free("a")
    hits, n = bm.get_computed_blocks(req("b", [50, 51, 52, 53, 54]))  # same hash, other tokens
    assert (hits, n) == ([], 0)
    # Identical tokens: block 0 verifies; block 1 shares the hash (never registered) and must not
    # resolve to block 0.
    hits, n = bm.get_computed_blocks(req("c", range(9)))
    assert n == 4 and len(hits) == 1


def test_cache_salt_isolates_tenants():
    bm = BlockManager(8, BS)
    compute(bm, req("a", range(9), salt="tenant-1"))
    bm.free("a")
    assert bm.get_computed_blocks(req("b", range(9), salt="tenant-2"))[1] == 0
    assert bm.get_computed_blocks(req("c", range(9)))[1] == 0
    assert bm.get_computed_blocks(req("d", range(9), salt="tenant-1"))[1] == 8


def test_eviction_takes_a_sequence_tail_first():
    bm = BlockManager(4, BS)
    a = compute(bm, req("a", range(13)))  # 3 full cached blocks + 1 partial
    bm.free("a")
    assert bm.num_free_blocks == 4
    # The uncached partial block is reused first: nothing is evicted.
    compute(bm, req("x", [900, 901]), use_cache=False)
    assert bm.block_ids("x") == [a[3]]
    assert bm.get_computed_blocks(req("a2", range(13)))[1] == 12
    # Then the cached blocks, last block of the sequence first.
    compute(bm, req("y", [800, 801]), use_cache=False)
    assert bm.block_ids("y") == [a[2]]
    assert bm.get_computed_blocks(req("a3", range(13)))[1] == 8
    compute(bm, req("z", [700, 701]), use_cache=False)
    assert bm.block_ids("z") == [a[1]]
    assert bm.get_computed_blocks(req("a4", range(13)))[1] == 4


def test_eviction_is_least_recently_freed_across_requests():
    bm = BlockManager(4, BS)
    pa, pb = list(range(5)), list(range(100, 105))
    compute(bm, req("a", pa))
    compute(bm, req("b", pb))
    bm.free("a")
    bm.free("b")
    # Touch a's block again (a hit), so b's becomes least recently used.
    compute(bm, req("a2", pa))
    bm.free("a2")
    # 3 blocks: the two uncached partial blocks, then one eviction.
    compute(bm, req("x", range(200, 212)), use_cache=False)
    assert bm.get_computed_blocks(req("b2", pb))[1] == 0
    assert bm.get_computed_blocks(req("a3", pa))[1] == 4


def test_uncached_blocks_are_reused_before_evicting_cached_ones():
    bm = BlockManager(3, BS)
    compute(bm, req("a", range(8)))  # 2 cached blocks
    bm.free("a")
    b = compute(bm, req("b", [500, 501]))  # a partial block, uncached, freed after a's
    bm.free("b")
    assert compute(bm, req("x", [900, 901]), use_cache=False) == b  # no eviction needed
    assert bm.get_computed_blocks(req("a2", range(9)))[1] == 8


def test_allocate_fails_atomically_with_cached_hits():
    bm = BlockManager(4, BS)
    compute(bm, req("a", range(9)))
    bm.free("a")
    big = req("b", list(range(8)) + list(range(300, 312)))  # 20 tokens: 5 blocks, 2 of them hits
    hits, n = bm.get_computed_blocks(big)
    assert len(hits) == 2
    big.num_computed_tokens = n
    before = (list(bm.ref_cnt), bm.num_free_blocks, dict(bm.cached), list(bm.free_queue))
    # 3 fresh blocks needed; 4 are free but 2 of those are the hits themselves.
    assert not bm.allocate_slots(big, 12, hits)
    assert (list(bm.ref_cnt), bm.num_free_blocks, dict(bm.cached), list(bm.free_queue)) == before
    assert bm.block_ids("b") == []
    assert bm.allocate_slots(big, 4, hits)  # a smaller chunk fits: 2 hits + 1 fresh
    assert bm.block_ids("b")[:2] == hits and bm.num_free_blocks == 1
    assert not bm.allocate_slots(big, 12)  # growing past the pool fails without side effects
    assert len(bm.block_ids("b")) == 3 and bm.num_free_blocks == 1
    bm.free("b")
    assert bm.num_free_blocks == 4


def test_allocate_for_tokens():
    bm = BlockManager(4, BS)
    blocks = bm.allocate_for_tokens("h", 9)
    assert blocks is not None and len(blocks) == 3 and bm.block_ids("h") == blocks
    assert bm.allocate_for_tokens("i", 8) is None and bm.block_ids("i") == []
    assert bm.num_free_blocks == 1
    with pytest.raises(ValueError):
        bm.allocate_for_tokens("h", 1)
    bm.free("h")
    assert bm.num_free_blocks == 4


def test_reset_prefix_cache():
    bm = BlockManager(4, BS)
    compute(bm, req("a", range(9)))
    assert not bm.reset_prefix_cache()  # a still holds blocks
    bm.free("a")
    assert bm.reset_prefix_cache()
    assert bm.get_computed_blocks(req("b", range(9)))[1] == 0
    assert bm.num_free_blocks == 4


def test_prefix_caching_disabled():
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    compute(bm, req("a", range(9)))
    bm.free("a")
    assert bm.get_computed_blocks(req("b", range(9))) == ([], 0)
    assert bm.cached == {} and bm.prefix_queries == 0


def test_host_block_pool():
    pool = HostBlockPool(3)
    a = pool.allocate(2)
    assert a == [0, 1] and pool.num_free_blocks == 1
    assert pool.allocate(2) is None and pool.num_free_blocks == 1
    pool.free(a)
    assert pool.num_free_blocks == 3
    with pytest.raises(ValueError):
        pool.free([0])  # double free
    b = pool.allocate(1)
    with pytest.raises(ValueError):
        pool.free(b + b)
    assert HostBlockPool(0).allocate(0) == []


# -- a sparse set of owned ids, as a shared KV pool grants them (shared/engine/kv_pool.py) ---------------

def test_sparse_ownership_uses_only_owned_ids():
    bm = BlockManager(20, BS, owned=[3, 11, 17])
    assert bm.num_blocks == 3 and bm.num_free_blocks == 3 and bm.capacity == 3
    r = req("a", range(12))
    assert bm.allocate_slots(r, 12)
    assert sorted(bm.block_ids("a")) == [3, 11, 17] and bm.usage == 1.0
    assert not bm.allocate_slots(req("b", range(1)), 1)  # no grow hook: fails as before
    bm.free("a")
    assert bm.num_free_blocks == 3 and bm.usage == 0
    with pytest.raises(ValueError, match=r"must lie in \[0, 4\)"):
        BlockManager(4, BS, owned=[4])


def test_add_blocks_are_reused_first_and_checked():
    bm = BlockManager(10, BS, owned=[0, 1])
    compute(bm, req("a", range(8)))
    bm.free("a")  # both blocks cached
    bm.add_blocks([5, 6])
    assert bm.num_blocks == 4 and bm.num_free_blocks == 4
    r = req("b", range(100, 108))
    assert bm.allocate_slots(r, 8)
    assert sorted(bm.block_ids("b")) == [5, 6] and len(bm.cached) == 2  # plain free before evicting cached
    with pytest.raises(ValueError, match="already owned"):
        bm.add_blocks([5])
    with pytest.raises(ValueError, match="outside"):
        bm.add_blocks([10])


def test_release_free_blocks_is_all_or_nothing_and_evicts():
    bm = BlockManager(8, BS)
    blocks = compute(bm, req("a", range(8)))  # 2 cached blocks, still referenced
    assert not bm.blocks_free(blocks) and bm.blocks_free([b for b in range(8) if b not in blocks])
    assert not bm.release_free_blocks([blocks[0], 7])  # one is referenced: nothing changes
    assert bm.num_blocks == 8 and 7 in bm.owned
    bm.free("a")
    assert bm.release_free_blocks([blocks[0], 7])
    assert bm.num_blocks == 6 and bm.num_free_blocks == 6 and blocks[0] not in bm.owned
    assert blocks[0] not in bm.cached.values() and bm.block_hash[blocks[0]] is None
    assert not bm.release_free_blocks([7])  # not owned any more
    hits, _ = bm.get_computed_blocks(req("c", list(range(8)) + [9]))
    assert hits == []  # the chain's first block is gone, so nothing after it is served either
    r = req("d", range(24))
    assert bm.allocate_slots(r, 24) and blocks[0] not in bm.block_ids("d") and 7 not in bm.block_ids("d")


def test_grow_hook_covers_the_shortfall_before_failing():
    asked: list[int] = []
    spare = [4, 5, 6, 7]

    def grow(n: int) -> list[int]:
        asked.append(n)
        give, spare[:] = spare[:n], spare[n:]
        return give

    bm = BlockManager(8, BS, owned=[0, 1], grow=grow, capacity=lambda: 6)
    assert bm.capacity == 6
    a = req("a", range(12))
    assert bm.allocate_slots(a, 12)  # 3 blocks with 2 owned: asks for exactly 1
    assert asked == [1] and bm.num_blocks == 3 and bm.num_free_blocks == 0
    assert bm.allocate_for_tokens("b", 8) is not None and asked == [1, 2]
    c = req("c", range(8))
    assert not bm.allocate_slots(c, 8)  # one spare left, two needed: fails, the grown one stays owned
    assert asked == [1, 2, 2] and bm.num_blocks == 6 and bm.num_free_blocks == 1
    assert bm.block_ids("c") == []
    bm.free("a")
    assert bm.allocate_slots(c, 8) and asked == [1, 2, 2]  # enough free: the hook is not asked


def test_decoded_blocks_are_cached_as_they_fill_across_prompt_and_output():
    """Token by token, as decode steps call it: every block registers when it fills (once), and the
    key of a block straddling prompt and output holds exactly its tokens."""
    bm = BlockManager(16, BS)
    r = req("a", range(6))  # block 1 straddles the prompt (4, 5) and the first outputs
    compute(bm, r)
    assert len(bm.cached) == 1
    for t in range(10):
        r.output_token_ids.append(100 + t)
        assert bm.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        bm.cache_blocks(r, r.num_computed_tokens)
        assert len(bm.cached) == r.num_computed_tokens // BS
    blocks = bm.block_ids("a")
    assert bm.block_key[blocks[1]][1] == (4, 5, 100, 101)
    assert bm.block_key[blocks[3]][1] == (106, 107, 108, 109)
    # a new request with the same 16 tokens hits all four full blocks, three of them made by decoding
    twin = req("b", list(range(6)) + [100 + t for t in range(10)] + [7])
    hits, n = bm.get_computed_blocks(twin)
    assert hits == blocks[:4] and n == 16
