"""KVPool growth: chunks are committed (backed) only up to a cap that the worker moves, inside one range
reserved at the most the pool may span, so views and block ids never change; lowering the cap gives
unowned and free chunks back (RSS really drops), the fixed buffer refuses to grow and says why."""

import logging
import random

import pytest
import torch

from kvrelay.shared.engine.block_manager import BlockManager
from kvrelay.shared.engine.kv_memory import PAGE
from kvrelay.shared.engine.kv_pool import KVPool, KVPoolFull
from kvrelay.shared.engine.request import Request
from kvrelay.shared.wire.sampling_params import SamplingParams

CHUNK = PAGE
# float32 (layers, block size, kv heads, head dim): 1024 bytes a block, four to a chunk
GEOMETRY = (1, 2, 1, 64)


def join(pool: KVPool, key: str, floor: int) -> BlockManager:
    layers, bs, heads, dim = GEOMETRY
    kv, ids = pool.attach(key, layers, bs, heads, dim, torch.float32, floor_blocks=floor)
    bm = BlockManager(kv.shape[2], bs, owned=ids, grow=lambda n: pool.grow(key, n))
    pool.bind(key, bm)
    return bm


def request(rid: str, n_tokens: int) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(range(n_tokens)),
                   sampling_params=SamplingParams(max_tokens=1), max_tokens=1)


def check(pool: KVPool) -> None:
    """Owned chunks are committed, and the committed count is what the flags say."""
    assert all(pool.committed[c] for c, o in enumerate(pool.owner) if o is not None)
    assert pool.committed_bytes == sum(pool._chunk_size(c) for c in range(pool.num_chunks) if pool.committed[c])


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_grows_only_up_to_the_cap_and_the_view_never_moves():
    pool = KVPool(8 * CHUNK, "cpu", chunk_bytes=CHUNK, max_bytes=32 * CHUNK)
    # its own size is committed from the start (as a fixed buffer is), the rest of the range is not
    assert pool.memory.growable and pool.nbytes == 32 * CHUNK and pool.committed_bytes == 8 * CHUNK
    kv, ids = pool.attach("a", *GEOMETRY[:3], GEOMETRY[3], torch.float32, floor_blocks=4)
    bm = BlockManager(kv.shape[2], GEOMETRY[1], owned=ids, grow=lambda n: pool.grow("a", n))
    pool.bind("a", bm)
    assert kv.shape[2] == 128  # the view spans the whole reserved range from the start
    bm.add_blocks(pool.grow("a", 1000))
    assert bm.num_blocks == 32 and pool.committed_bytes == 8 * CHUNK == pool.cap  # the cap, not the range
    assert pool.capacity("a") == 32
    assert pool.set_cap(20 * CHUNK)
    assert pool.committed_bytes == 8 * CHUNK  # raising commits nothing until a model asks
    assert pool.free_bytes == 12 * CHUNK and pool.reclaimable_bytes() == 19 * CHUNK  # all but a's floor chunk
    bm.add_blocks(pool.grow("a", 1000))
    assert bm.num_blocks == 80 and pool.committed_bytes == 20 * CHUNK and pool.capacity("a") == 80
    kv2, _ = pool.attach("b", *GEOMETRY[:3], GEOMETRY[3], torch.float32, floor_blocks=4)
    assert kv2.data_ptr() == kv.data_ptr() == pool.buffer.data_ptr()  # one range for every model, forever
    check(pool)


def test_lowering_the_cap_decommits_unowned_then_free_chunks_down_to_floors():
    pool = KVPool(4 * CHUNK, "cpu", chunk_bytes=CHUNK, max_bytes=16 * CHUNK)
    pool.set_cap(16 * CHUNK)
    a, b = join(pool, "a", floor=4), join(pool, "b", floor=4)
    a.add_blocks(pool.grow("a", 32))  # 8 more chunks
    assert pool.committed_bytes == 10 * CHUNK
    assert a.allocate_slots(request("busy", 2 * 32), 2 * 32)  # 32 of a's 36 blocks in use
    assert pool.reclaimable_bytes(cap=6 * CHUNK) == 0  # a's busy chunks and b's floor: nothing for a newcomer
    assert not pool.set_cap(6 * CHUNK)  # a's blocks in use keep it above 6 chunks
    m = pool.members["a"]
    assert pool.committed_bytes > pool.cap and b.num_blocks == 4
    # every wholly free chunk of a's went, except block 0's, which stays committed
    assert all(not a.blocks_free(list(pool._blocks_in(m, c))) for c in m.chunks - pool.keep)
    committed = pool.committed_bytes
    b.add_blocks(pool.grow("b", 40))  # above the cap it may steal, but commits nothing new
    assert pool.committed_bytes == committed
    a.free("busy")
    assert pool.set_cap(6 * CHUNK)  # called again, it takes what became free, down to a's floor
    assert pool.committed_bytes <= 6 * CHUNK and a.num_blocks >= 4 and b.num_blocks >= 4
    pool.set_cap(2 * CHUNK)
    assert a.num_blocks == 4 and b.num_blocks == 4  # never below a floor
    assert pool.set_cap(16 * CHUNK)
    check(pool)


def test_detach_above_the_cap_gives_its_chunks_back():
    pool = KVPool(4 * CHUNK, "cpu", chunk_bytes=CHUNK, max_bytes=16 * CHUNK)
    pool.set_cap(16 * CHUNK)
    a = join(pool, "a", floor=4)
    a.add_blocks(pool.grow("a", 60))
    assert pool.committed_bytes == 16 * CHUNK
    assert a.allocate_slots(request("busy", 2 * 64), 2 * 64)  # every block in use
    assert not pool.set_cap(4 * CHUNK)
    a.free("busy")
    assert a.release_free_blocks(sorted(a.owned))
    pool.detach("a")
    assert pool.committed_bytes <= 4 * CHUNK
    check(pool)


def test_decommit_really_returns_memory():
    """RSS (the kernel's count of this process's resident pages) rises as committed chunks are written and
    falls when the cap is lowered."""
    mib = 1 << 20
    pool = KVPool(4 * mib, "cpu", chunk_bytes=mib, max_bytes=512 * mib)
    pool.attach("a", 1, 16, 1, 64, torch.float32, floor_blocks=4)  # 4 KiB blocks
    bm = BlockManager(pool.nbytes // 4096, 16, owned=pool.members["a"].blocks, grow=lambda n: pool.grow("a", n))
    pool.bind("a", bm)
    pool.set_cap(260 * mib)
    bm.add_blocks(pool.grow("a", 256 * 256))
    assert pool.committed_bytes == 260 * mib
    before = rss()
    for c in sorted(pool.members["a"].chunks):
        pool.buffer[c * mib:(c + 1) * mib].fill_(1)  # a model writing its KV
    written = rss()
    assert written - before > 200 * mib
    assert pool.set_cap(4 * mib)
    after = rss()
    assert written - after > 200 * mib, (before, written, after)
    assert pool.buffer[pool.nbytes - mib:].sum() == 0  # decommitted pages read as zeros again


def test_fixed_pool_refuses_to_grow_and_says_why(caplog):
    pool = KVPool(4 * CHUNK, "cpu", chunk_bytes=CHUNK)
    assert not pool.memory.growable and pool.committed_bytes == 4 * CHUNK
    with caplog.at_level(logging.WARNING):
        assert pool.set_cap(64 * CHUNK)
        assert pool.set_cap(64 * CHUNK)
    assert pool.cap == 4 * CHUNK
    said = [r.getMessage() for r in caplog.records if "KV pool stays" in r.getMessage()]
    assert len(said) == 1 and "sized once" in said[0]  # once, with the reason
    fixed = KVPool(4 * CHUNK, "cpu", chunk_bytes=CHUNK, max_bytes=64 * CHUNK, fixed_because="CUDA IPC")
    assert not fixed.memory.growable and fixed.nbytes == 4 * CHUNK and fixed.memory.why_fixed == "CUDA IPC"


@pytest.mark.parametrize("seed", range(4))
def test_random_caps_keep_every_invariant(seed):
    rnd = random.Random(seed)
    pool = KVPool(6 * CHUNK, "cpu", chunk_bytes=CHUNK, max_bytes=24 * CHUNK)
    bms = {k: join(pool, k, floor=4) for k in ("a", "b", "c")}
    held: dict[str, list[str]] = {k: [] for k in bms}
    for i in range(300):
        k = rnd.choice(list(bms))
        op = rnd.random()
        if op < 0.4:
            n = rnd.randint(1, 12)
            if bms[k].allocate_slots(request(f"r{i}", n), n):
                held[k].append(f"r{i}")
        elif op < 0.7 and held[k]:
            bms[k].free(held[k].pop(rnd.randrange(len(held[k]))))
        else:
            ok = pool.set_cap(rnd.randint(6, 24) * CHUNK)
            assert ok == (pool.committed_bytes <= pool.cap)
        check(pool)
        for key, bm in bms.items():
            m = pool.members[key]
            assert m.blocks == bm.owned and len(m.blocks) >= m.floor_blocks
            assert all(pool.owner[c] == key for c in m.chunks)


def test_a_view_held_to_the_pools_own_size_gets_no_chunk_past_it_and_is_counted_so():
    """A parallel group's view (``within_base``) ends at the pool's own size: growth past it and another
    model's free chunks there give it nothing, and what a load would find reclaimable says the same."""
    pool = KVPool(4 * CHUNK, "cpu", chunk_bytes=CHUNK, max_bytes=16 * CHUNK)
    pool.set_cap(16 * CHUNK)
    a = join(pool, "a", floor=4)
    a.add_blocks(pool.grow("a", 12))  # the pool's own 4 chunks
    assert a.num_blocks == 16 and pool.committed_bytes == 4 * CHUNK
    assert a.allocate_slots(request("busy", 2 * 16), 2 * 16)  # all of them in use
    a.add_blocks(pool.grow("a", 48))  # the rest of the range, free
    assert a.num_blocks == 64 and pool.committed_bytes == 16 * CHUNK
    assert pool.reclaimable_bytes() == 12 * CHUNK and pool.reclaimable_bytes(within_base=True) == 0
    layers, bs, heads, dim = GEOMETRY
    with pytest.raises(KVPoolFull):
        pool.attach("g", layers, bs, heads, dim, torch.float32, floor_blocks=4, within_base=True)
    a.free("busy")
    assert pool.reclaimable_bytes(within_base=True) == 4 * CHUNK  # a keeps its floor past them
    kv, ids = pool.attach("g", layers, bs, heads, dim, torch.float32, floor_blocks=4, within_base=True)
    g = BlockManager(kv.shape[2], bs, owned=ids, grow=lambda n: pool.grow("g", n))
    pool.bind("g", g)
    assert kv.shape[2] == 16 and max(ids) < 16  # its view: the pool's own 4 chunks, not the 16 reserved
    g.add_blocks(pool.grow("g", 100))
    assert g.num_blocks == 16 and max(g.owned) < 16  # every chunk in it, none past it
    assert pool.capacity("g") == 16 and a.num_blocks == 48  # a lost only what lay in g's view
    check(pool)
