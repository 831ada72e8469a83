"""KVPool: chunk ownership across block geometries, floors, stealing only free chunks (evicting the
victim's cached prefixes), detach, and the block-major view working with the KV copy paths."""

import pytest
import torch

from kvrelay.kernels import reference
from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.shared.engine.block_manager import BlockManager
from kvrelay.shared.engine.kv_pool import KVPool, KVPoolFull
from kvrelay.shared.engine.request import Request
from kvrelay.shared.handoff.blocks import block_runs, copy_blocks, gather_blocks, kv_strides, scatter_blocks
from kvrelay.shared.wire.sampling_params import SamplingParams

CHUNK = 1024
# (num_layers, block_size, num_kv_heads, head_dim) in float32: 256 bytes a block (4 per chunk, never
# straddling) and 384 bytes (8 blocks per 3 chunks, two of them straddling a chunk boundary)
SMALL = (1, 2, 1, 16)
ODD = (3, 2, 1, 8)


def join(pool: KVPool, key: str, geometry: tuple[int, int, int, int], floor: int) -> tuple[torch.Tensor, BlockManager]:
    layers, bs, heads, dim = geometry
    kv, ids = pool.attach(key, layers, bs, heads, dim, torch.float32, floor_blocks=floor)
    bm = BlockManager(kv.shape[2], bs, owned=ids, grow=lambda n: pool.grow(key, n))
    pool.bind(key, bm)
    return kv, bm


def chunks_of(pool: KVPool, key: str, block: int) -> range:
    bb = pool.members[key].block_bytes
    return range(block * bb // pool.chunk_bytes, ((block + 1) * bb - 1) // pool.chunk_bytes + 1)


def check_ownership(pool: KVPool, bms: dict[str, BlockManager]) -> None:
    """Every model owns exactly the blocks whose chunks are all its own, and its manager agrees."""
    for key, bm in bms.items():
        m = pool.members[key]
        usable = {b for b in range(m.num_blocks) if all(pool.owner[c] == key for c in chunks_of(pool, key, b))}
        assert m.blocks == usable == bm.owned, key


def request(rid: str, tokens: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=1),
                   max_tokens=1)


def test_view_is_block_major_over_the_whole_buffer():
    pool = KVPool(4 * CHUNK, "cpu", chunk_bytes=CHUNK)
    kv, _ = join(pool, "a", ODD, floor=1)
    assert kv.shape == (3, 2, 4 * CHUNK // 384, 2, 1, 8)  # [L, 2, N, bs, Hkv, D]
    assert kv.data_ptr() == pool.buffer.data_ptr() and kv.stride(2) == 384 // 4
    assert list(kv.stride()) == kv_strides(list(kv.shape), block_major=True)
    kv[:, :, 5] = 7.0  # block 5 is bytes [5 * 384, 6 * 384), every layer and K/V
    nonzero = pool.buffer.view(torch.float32).nonzero().flatten()
    assert nonzero.min().item() == 5 * 384 // 4 and nonzero.max().item() == 6 * 384 // 4 - 1


def test_straddling_blocks_need_both_chunks():
    pool = KVPool(4 * CHUNK, "cpu", chunk_bytes=CHUNK)
    _, bm = join(pool, "odd", ODD, floor=2)
    assert sorted(bm.owned) == [0, 1]  # chunk 0 = bytes [0, 1024): block 2 ([768, 1152)) straddles
    grown = pool.grow("odd", 1)
    assert grown == [2, 3, 4]  # chunk 1 completes block 2 and holds 3, 4 whole
    bm.add_blocks(grown)
    check_ownership(pool, {"odd": bm})
    assert pool.stats()["odd"]["owned_blocks"] == 5


def test_two_geometries_share_bytes_without_overlap():
    pool = KVPool(8 * CHUNK, "cpu", chunk_bytes=CHUNK)
    kv_a, a = join(pool, "a", SMALL, floor=6)  # 2 chunks
    kv_b, b = join(pool, "b", ODD, floor=4)
    a.add_blocks(pool.grow("a", 5))
    b.add_blocks(pool.grow("b", 3))
    check_ownership(pool, {"a": a, "b": b})
    assert pool.free_bytes == sum(CHUNK for o in pool.owner if o is None)
    kv_a[:, :, sorted(a.owned)] = 1.0
    kv_b[:, :, sorted(b.owned)] = 2.0
    assert (kv_a[:, :, sorted(a.owned)] == 1.0).all()  # b's writes never touched a's blocks
    assert (kv_b[:, :, sorted(b.owned)] == 2.0).all()


def test_floor_too_big_raises_with_bytes():
    pool = KVPool(4 * CHUNK, "cpu", chunk_bytes=CHUNK)
    join(pool, "a", SMALL, floor=12)  # 3 of the 4 chunks
    with pytest.raises(KVPoolFull, match=r"needs at least 1536 bytes, but only 1024 of the pool's 4096 bytes"):
        pool.attach("b", *ODD, torch.float32, floor_blocks=4)
    assert "b" not in pool.members and pool.free_bytes == CHUNK  # a failed attach takes nothing
    with pytest.raises(KVPoolFull, match="the whole pool is 4096"):
        pool.attach("c", *SMALL, torch.float32, floor_blocks=17)


def test_grow_steals_only_free_chunks_above_the_floor():
    pool = KVPool(6 * CHUNK, "cpu", chunk_bytes=CHUNK)
    _, a = join(pool, "a", SMALL, floor=4)
    a.add_blocks(pool.grow("a", 100))  # an idle model took the whole pool
    assert a.num_blocks == 24 and pool.free_bytes == 0
    busy = request("busy", list(range(8)))
    assert a.allocate_slots(busy, 8)
    held = a.block_ids("busy")
    assert held == [23, 22, 21, 20]  # grown blocks are used first: chunk 5, the first a victim offers
    _, b = join(pool, "b", SMALL, floor=4)
    b.add_blocks(pool.grow("b", 100))
    # chunk 5 is in use, so b took chunks 4..0 until a was down to its floor: the busy chunk
    assert a.owned == set(held) and b.num_blocks == 20 and a.num_free_blocks == 0
    assert all(a.ref_cnt[blk] == 1 for blk in held)
    check_ownership(pool, {"a": a, "b": b})
    a.free("busy")
    assert pool.grow("b", 100) == []  # free now, but a is at its floor
    assert a.num_blocks == 4


def test_stolen_cached_blocks_are_evicted_and_never_served():
    pool = KVPool(4 * CHUNK, "cpu", chunk_bytes=CHUNK)
    _, a = join(pool, "a", SMALL, floor=4)
    a.add_blocks(pool.grow("a", 12))
    prompts = [[i * 100 + t for t in range(8)] + [999] for i in range(3)]  # 4 full blocks of 2 tokens + 1
    for i, p in enumerate(prompts):
        req = request(f"r{i}", p)
        assert a.allocate_slots(req, len(p))
        a.cache_blocks(req, len(p))
        a.free(req.request_id)
    # grown blocks are handed out from the top: r0 cached 15..12, r1 11..8, r2 7..4
    assert sorted(a.cached.values()) == list(range(4, 16))
    _, b = join(pool, "b", SMALL, floor=8)  # no unowned chunk: a gives up chunks 3 and 2
    assert b.owned == set(range(8, 16)) and a.owned == set(range(8))
    assert sorted(a.cached.values()) == [4, 5, 6, 7]
    assert all(a.block_hash[blk] is None and a.block_key[blk] is None for blk in range(8, 16))
    hits = [a.get_computed_blocks(request(f"q{i}", p))[0] for i, p in enumerate(prompts)]
    assert hits == [[], [], [7, 6, 5, 4]]
    # b writes its own KV into those bytes and goes; a grows back into them: still no stale hits
    assert b.allocate_slots(request("w", list(range(16))), 16)
    b.free("w")
    assert b.release_free_blocks(sorted(b.owned))
    pool.detach("b")
    a.add_blocks(pool.grow("a", 8))
    assert a.owned == set(range(16))
    assert [a.get_computed_blocks(request(f"z{i}", p))[0] for i, p in enumerate(prompts)] == [[], [], [7, 6, 5, 4]]


def test_victim_with_most_free_blocks_goes_first():
    pool = KVPool(8 * CHUNK, "cpu", chunk_bytes=CHUNK)
    _, a = join(pool, "a", SMALL, floor=4)
    _, b = join(pool, "b", SMALL, floor=4)
    a.add_blocks(pool.grow("a", 8))
    b.add_blocks(pool.grow("b", 16))  # exactly the unowned rest: no steal from a yet
    assert (a.num_blocks, b.num_blocks) == (12, 20)
    assert a.allocate_slots(request("x", list(range(12))), 12)  # a: 6 free, b: 20 free
    _, c = join(pool, "c", SMALL, floor=4)
    assert (a.num_blocks, b.num_blocks, c.num_blocks) == (12, 16, 4)
    c.add_blocks(pool.grow("c", 4))
    assert (a.num_blocks, b.num_blocks, c.num_blocks) == (12, 12, 8)  # still b: it has more free blocks
    check_ownership(pool, {"a": a, "b": b, "c": c})


def test_victims_tied_on_free_blocks_give_by_least_recent_demand():
    pool = KVPool(4 * CHUNK, "cpu", chunk_bytes=CHUNK)
    _, a = join(pool, "a", SMALL, floor=4)
    _, b = join(pool, "b", SMALL, floor=4)
    b.add_blocks(pool.grow("b", 4))
    a.add_blocks(pool.grow("a", 4))  # a asked last: 8 free each, b is the idler
    _, c = join(pool, "c", SMALL, floor=4)
    assert (a.num_blocks, b.num_blocks) == (8, 4)


def test_reclaimable_bytes_capacity_and_detach():
    pool = KVPool(6 * CHUNK, "cpu", chunk_bytes=CHUNK)
    _, a = join(pool, "a", SMALL, floor=4)
    a.add_blocks(pool.grow("a", 100))
    assert pool.free_bytes == 0 and pool.reclaimable_bytes() == 5 * CHUNK  # all but a's floor
    assert a.allocate_slots(request("x", list(range(40))), 40)  # 20 blocks: chunks 5..1
    assert pool.reclaimable_bytes() == CHUNK  # only chunk 0 is all free
    assert pool.capacity("a") == 24
    _, b = join(pool, "b", ODD, floor=2)  # takes chunk 0: blocks 0 and 1 of its geometry
    assert sorted(b.owned) == [0, 1] and pool.reclaimable_bytes() == 0
    assert pool.capacity("a") == 20  # b's floor needs a chunk
    with pytest.raises(ValueError, match="already attached"):
        pool.attach("b", *ODD, torch.float32, floor_blocks=1)
    pool.detach("b")
    a.free("x")
    assert a.release_free_blocks(sorted(a.owned))
    pool.detach("a")
    assert pool.free_bytes == 6 * CHUNK and not pool.members and all(o is None for o in pool.owner)


def test_last_chunk_may_be_short():
    pool = KVPool(2 * CHUNK + 512, "cpu", chunk_bytes=CHUNK)
    _, a = join(pool, "a", SMALL, floor=10)
    assert a.num_blocks == 10 and pool.free_bytes == 0


def test_copy_paths_work_on_the_block_major_view():
    pool = KVPool(8 * CHUNK, "cpu", chunk_bytes=CHUNK)
    kv, bm = join(pool, "a", ODD, floor=4)
    kv.copy_(torch.randn(kv.shape))
    plain = torch.randn(kv.shape[:2] + (30,) + kv.shape[3:])  # an ordinary layer-major cache
    ids = [3, 7, 8, 12, 0, 20]
    index = torch.tensor(ids)
    got = gather_blocks(kv, range(1, 3), index)
    assert torch.equal(got, kv[1:3][:, :, index])
    scatter_blocks(kv, 0, torch.tensor(ids[::-1]), plain[:, :, :6])
    assert torch.equal(kv[:, :, ids[::-1]], plain[:, :, :6])
    src, dst = list(range(0, 20, 2)), list(range(19, -1, -2))  # > 8 runs: the row gather path
    assert len(block_runs(src, dst)) > 8
    copy_blocks(kv, src, plain, dst)
    assert torch.equal(plain[:, :, dst], kv[:, :, src])
    copy_blocks(plain, dst[:3], kv, src[:3])  # a few runs: slices
    assert torch.equal(kv[:, :, src[:3]], plain[:, :, dst[:3]])
    src2, dst2 = list(range(0, 20, 2)), list(range(19, 0, -2))  # pool view to pool view, many runs
    before = kv[:, :, src2].clone()
    copy_blocks(kv, src2, kv, dst2)
    assert torch.equal(kv[:, :, dst2], before)
    # layer ranges, as the layer-by-layer handoff copies them: each range touches its layers only
    for a, b in ((0, 1), (1, kv.shape[0])):
        for pair in ((src, dst), (dst[:3], src[:3])):  # the row gather path, then slices
            plain.zero_()
            copy_blocks(kv, pair[0], plain, pair[1], range(a, b))
            assert torch.equal(plain[a:b][:, :, pair[1]], kv[a:b][:, :, pair[0]])
            assert not plain[:a].any() and not plain[b:].any()


def test_reference_kernels_read_and_write_the_pooled_view():
    torch.manual_seed(0)
    pool = KVPool(8 * CHUNK, "cpu", chunk_bytes=CHUNK)
    kv, _ = join(pool, "a", (1, 4, 2, 8), floor=4)
    layer = kv[0]  # [2, N, bs, Hkv, D], strided
    plain = torch.zeros(layer.shape)
    tokens, table = 7, torch.tensor([[9, 3]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, p // 4]) * 4 + p % 4 for p in range(tokens)])
    k, v = torch.randn(tokens, 2, 8), torch.randn(tokens, 2, 8)
    for cache in (layer, plain):
        reference.write_kv(k, v, cache, slots)
    assert torch.equal(layer, plain)
    q = torch.randn(tokens, 4, 8)
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.tensor([0, tokens]),
                             seq_lens=torch.tensor([tokens]), block_tables=table, query_start_loc_cpu=[0, tokens],
                             seq_lens_cpu=[tokens], max_query_len=tokens, max_seq_len=tokens)
    assert torch.equal(reference.paged_attention(q, layer, meta, 0.3), reference.paged_attention(q, plain, meta, 0.3))
    decode = AttentionMetadata(slot_mapping=slots[-1:], query_start_loc=torch.tensor([0, 1]),
                               seq_lens=torch.tensor([tokens]), block_tables=table, query_start_loc_cpu=[0, 1],
                               seq_lens_cpu=[tokens], max_query_len=1, max_seq_len=tokens)
    assert decode.decode_only
    assert torch.equal(reference.paged_attention(q[-1:], layer, decode, 0.3),
                       reference.paged_attention(q[-1:], plain, decode, 0.3))


def test_default_chunk_size():
    assert KVPool(1 << 30, "cpu").chunk_bytes == 2 << 20
    assert KVPool(2 << 20, "cpu").chunk_bytes == 32 << 10  # a small pool still has 64 chunks to share
    assert KVPool(1000, "cpu").chunk_bytes == 4096 and KVPool(1000, "cpu").num_chunks == 1


@pytest.mark.parametrize("seed", range(6))
def test_usable_blocks_are_exactly_the_fully_owned_ones_across_random_geometries(seed):
    # blocks smaller than a chunk (many inside one, two straddling its edges), about one chunk, and larger
    rng = torch.Generator().manual_seed(seed)
    pool = KVPool(24 * CHUNK, "cpu", chunk_bytes=CHUNK)
    bms = {}
    for i, dim in enumerate(torch.randint(1, 200, (3,), generator=rng).tolist()):
        key = f"m{i}"
        _, bms[key] = join(pool, key, (1, 2, 1, dim), floor=1)
        check_ownership(pool, bms)
    for _ in range(8):
        key = f"m{torch.randint(0, 3, (1,), generator=rng).item()}"
        bms[key].add_blocks(pool.grow(key, int(torch.randint(1, 40, (1,), generator=rng))))
        check_ownership(pool, bms)
