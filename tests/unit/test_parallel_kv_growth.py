"""A tensor- or pipeline-parallel group beside a single-rank model over a growable KV pool (real rank processes
over gloo, a real mmap-backed pool, no Redis): the pool reserves its own size plus the weights budget, but the
group's other ranks each allocate a cache of the group's block count, so the group is held to the pool's own
size. Its other rank's cache stays that small however large the reserved range, the single-rank model still
grows past it, and the group's greedy tokens after that growth are the single-rank model's."""

import time

import psutil
import pytest

from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig
from kvrelay.shared.engine.kv_memory import PAGE
from kvrelay.shared.engine.kv_pool import KVPool
from kvrelay.shared.wire.protocol import ControlCommand
from kvrelay.shared.worker.model_host import ModelHost
from kvrelay.shared.worker.model_memory import estimate_weight_bytes, group_weight_bytes, kv_floor_bytes
from tests.conftest import make_tiny_model
from tests.unit.model_host_requests import serve_greedy
from tests.unit.parallel_ranks import children
from tests.unit.test_model_host import Hooks, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BLOCK = 4096  # the tiny llama's KV block on one rank: 2 layers x K/V x 8 tokens x 2 KV heads x 16 dims x fp32
BASE = 32 * BLOCK  # the pool's own size: both floors and room to share
ROOM = 1 << 30  # weights budget no weights use: the pool may grow into it (reserved, backed only as used)
PROMPT, NEW, N = 40, 4, 12  # 6 blocks a request to finish: 12 at once need far more than the pool's own size


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("grow-group") / "llama"))  # GQA: 4 heads, 2 KV


def _engine(path: str, tp: int = 1, pp: int = 1) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=path, dtype="float32", max_model_len=64),
                        cache=CacheConfig(block_size=8), device="cpu", tensor_parallel_size=tp,
                        pipeline_parallel_size=pp)


def _load(name: str) -> ControlCommand:
    return ControlCommand(command_id=f"load-{name}-{time.monotonic_ns()}", op="load", name=name)


@pytest.mark.parametrize("sizes", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_a_group_on_a_growable_pool_stays_within_its_own_size(llama, sizes):
    before = children()
    whole = estimate_weight_bytes(_engine(llama))
    counted = estimate_weight_bytes(_engine(llama, *sizes))  # on the CPU: every shard
    assert counted == group_weight_bytes([counted], "cpu")
    budget = whole + counted + ROOM
    pool = KVPool(BASE, "cpu", chunk_bytes=PAGE, max_bytes=BASE + budget)  # as host_budget makes it
    assert pool.memory.growable and pool.nbytes == BASE + budget
    host = ModelHost(_engine(""), hold_finished_kv=False, pool=pool, weights_budget=budget, skip_warmup=True,
                     configured_paths={"one": llama, "group": llama}, report=lambda r: None,
                     parallel_sizes={"group": sizes})
    host.hooks = Hooks()
    try:
        run(host, _load("one"), _load("group"))
        # the room less what the two keep beside their weights (their rotary tables, KV scales)
        assert sorted(host.slots) == ["group", "one"] and pool.cap == BASE + ROOM - host.overhead_used
        group = host.slots["group"].core
        # rank 0's view, its block manager and every other rank's cache hold the pool's own size, not the range
        # reserved for growth (a cache the size of the weights budget on every other rank)
        block_bytes = group.block_bytes
        assert block_bytes == kv_floor_bytes(_engine(llama, *sizes)) // 8 == BLOCK // 2
        assert group.runner.kv_cache.shape[2] == group.block_manager.id_space == BASE // block_bytes

        # more than the pool's own size: it grows into the weights budget
        _, want = serve_greedy(host, "one", N, PROMPT, NEW)
        assert pool.committed_bytes > BASE
        assert max(c for c in pool.members["one"].chunks) * pool.chunk_bytes >= BASE

        _, got = serve_greedy(host, "group", N, PROMPT, NEW)  # takes the one's free chunks within its own size
        assert got == want
        # the other rank has long allocated its cache (its steps ran): a reserved-range one would be resident
        (pid,) = group.runner.ranks.pids
        assert psutil.Process(pid).memory_info().rss < ROOM // 2
        blocks = pool.members["group"].blocks
        assert len(blocks) > 8 and max(blocks) < BASE // block_bytes  # grown, and never past the other ranks' caches
    finally:
        for inst in list(host.slots):
            host.unload_now(inst)
    assert children() == before
