"""A growable KV pool on a GPU (shared/engine/cuda_vmm.py): the reserved range costs no device memory,
committing chunks takes it and lowering the cap gives it back, as the driver reports it
(``torch.cuda.mem_get_info``); and a model's greedy tokens are the same from blocks committed after a
grow, CUDA graphs included. ``pytest -m gpu tests/gpu/test_kv_pool_vmm_gpu.py``; skips without CUDA."""

import pytest
import torch

from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvrelay.shared.engine.block_manager import BlockManager
from kvrelay.shared.engine.engine_core import EngineCore
from kvrelay.shared.engine.kv_pool import KVPool
from kvrelay.shared.wire.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MIB, GIB = 1 << 20, 1 << 30


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_commit_takes_device_memory_and_a_lower_cap_gives_it_back():
    torch.zeros(1 << 20, device="cuda").fill_(1.0)  # CUDA's context and the zeroing kernel's module, loaded now
    # mem_get_info is the device's: other test processes allocating and freeing meanwhile move it either way,
    # so three pools are made and each bound is judged on the reading most in its favour: another process's
    # allocation inflates a reading, its free shrinks one, but not all three alike
    taken, pools = [], []
    for _ in range(3):
        before = free_bytes()
        pools.append(KVPool(256 * MIB, "cuda", max_bytes=8 * GIB))
        assert pools[-1].memory.growable, pools[-1].memory.why_fixed
        taken.append(before - free_bytes())
    # its own size is backed, not the 8 GiB of address space (the margin: lazily loaded kernel modules)
    assert max(taken) >= 256 * MIB and min(taken) < 1 * GIB, taken
    pool = pools.pop()
    # an 8B model's geometry: 2 MiB blocks (32 layers, K/V, 16 tokens, 8 heads of 128, bf16)
    kv, ids = pool.attach("m", 32, 16, 8, 128, torch.bfloat16, floor_blocks=8)
    bm = BlockManager(kv.shape[2], 16, owned=ids, grow=lambda n: pool.grow("m", n))
    pool.bind("m", bm)
    took, gave = [], []
    # likewise the pool commits and gives back three times and the largest swings are judged
    for _ in range(3):
        assert pool.set_cap(4 * GIB)
        start = free_bytes()
        bm.add_blocks(pool.grow("m", 2000))
        assert pool.committed_bytes > 3 * GIB
        grown = free_bytes()
        top = max(bm.owned)
        kv[:, :, top] = 1.5  # the highest block, in the last chunk committed: mapped and writable
        assert kv[:, :, top].float().mean().item() == 1.5
        assert pool.set_cap(256 * MIB)  # every block is free: all but what the floor needs goes back
        assert pool.committed_bytes <= 256 * MIB and bm.num_blocks >= 8
        took.append(start - grown)
        gave.append(free_bytes() - grown)
    assert max(took) > 3 * GIB - 64 * MIB, took  # the commit is real device memory
    assert max(gave) > 3 * GIB - 320 * MIB, gave

def greedy(core: EngineCore, prompts: list[list[int]]) -> tuple[list[list[int]], set[int]]:
    """Each prompt's greedy tokens, all in one batch, and the block ids they used."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ids = [f"g{i}-{id(prompts)}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        core.add_request(core.make_request(rid, p, params))
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    used: set[int] = set()
    while core.has_unfinished():
        for o in core.step():
            out[o.request_id] += o.new_token_ids
        used.update(b for blocks in core.block_manager.req_blocks.values() for b in blocks)
    return [out[rid] for rid in ids], used


def test_greedy_tokens_are_the_same_from_blocks_committed_by_a_grow():
    base = 32 * MIB
    pool = KVPool(base, "cuda", max_bytes=2 * GIB)
    assert pool.memory.growable, pool.memory.why_fixed
    config = EngineConfig(ModelConfig("dummy:smollm2-135m", load_format="dummy", dtype="bfloat16", max_model_len=512,
                                      seed=3), cache=CacheConfig(enable_prefix_caching=False),
                          scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048), device="cuda")
    core = EngineCore(config, kv_pool=pool, kv_pool_key="m")
    assert core.runner.graphs is not None  # decode runs CUDA graphs, captured over the pool's range
    prompts = [[5, 17, 99, 203, 7], list(range(40, 140)), [1] * 33]
    before, _ = greedy(core, prompts)
    assert pool.committed_bytes <= base

    pool.set_cap(2 * GIB)
    many = [[(7 * i + t) % 3000 + 1 for t in range(200)] for i in range(48)]  # ~250 MB of KV at once
    greedy(core, many)
    assert pool.committed_bytes > 4 * base  # it grew
    bm = core.block_manager
    for b in sorted(bm.owned):  # each to the front in turn: the highest (committed last) ends first, used first
        bm.free_queue.move_to_end(b, last=False)
    after, used = greedy(core, prompts)
    block_bytes = pool.members["m"].block_bytes
    assert min(used) * block_bytes >= base  # every block of this run lies in memory committed by the grow
    assert after == before
