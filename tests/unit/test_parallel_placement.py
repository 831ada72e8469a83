"""A tensor- or pipeline-parallel model in a multi-model worker is one placement over its ranks (real rank
processes over gloo, no Redis): each model its own group beside single-rank ones over the shared KV pool,
giving the same greedy tokens; the group's whole weights count against the CPU budget (on CUDA its largest
shard, per device); its status names its sizes and every rank's process, device and shard; evicting it
stops its ranks; a size its model cannot split fails before any process starts."""

import os
import time

import pytest

from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig
from kvrelay.shared.engine.kv_pool import KVPool
from kvrelay.shared.engine.ranks.checks import rank_weight_bytes
from kvrelay.shared.engine.ranks.group import rank_device
from kvrelay.shared.wire.protocol import ControlCommand
from kvrelay.shared.worker.model_host import ModelHost
from kvrelay.shared.worker.model_memory import estimate_weight_bytes, group_weight_bytes, kv_floor_bytes
from kvrelay.shared.worker.model_overhead import estimate_costs
from tests.conftest import make_tiny_model
from tests.unit.parallel_ranks import children
from tests.unit.test_model_host import Hooks, generate, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("placement") / "llama"))  # GQA: 4 heads, 2 KV


def _engine(path: str, tp: int = 1, pp: int = 1, device: str = "cpu") -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=path, dtype="float32", max_model_len=64),
                        cache=CacheConfig(block_size=8), device=device, tensor_parallel_size=tp,
                        pipeline_parallel_size=pp)


def _load(name: str) -> ControlCommand:
    return ControlCommand(command_id=f"load-{name}-{time.monotonic_ns()}", op="load", name=name)


def test_a_group_counts_its_shards_per_device_on_cuda_and_all_of_them_on_the_cpu(llama):
    whole = estimate_weight_bytes(_engine(llama))
    tp = rank_weight_bytes(_engine(llama, tp=2))
    pp = rank_weight_bytes(_engine(llama, pp=2))
    # TP: each rank half of every sharded projection, the norms on both; PP: the head on the last stage
    assert len(tp) == 2 and max(tp) < whole <= sum(tp)
    assert len(pp) == 2 and sum(pp) == whole and pp[0] != pp[1]
    assert group_weight_bytes(tp, "cuda:0") == max(tp)
    assert group_weight_bytes(tp, "cpu") == sum(tp) == estimate_weight_bytes(_engine(llama, tp=2))
    # the KV floor a group keeps in the shared pool is rank 0's: its KV heads (1 of 2), its stage's layers (1 of 2)
    floor = kv_floor_bytes(_engine(llama))
    assert kv_floor_bytes(_engine(llama, tp=2)) == kv_floor_bytes(_engine(llama, pp=2)) == floor // 2
    assert kv_floor_bytes(_engine(llama, tp=4)) == floor // 2  # 2 KV heads over 4 ranks: one each, replicated


def test_models_of_their_own_parallel_sizes_share_one_worker_as_one_placement_each(llama):
    groups_share_a_worker_as_one_placement_each(llama, "cpu")


def groups_share_a_worker_as_one_placement_each(llama: str, device: str) -> None:
    """The body, on ``device`` (tests/gpu/test_parallel_placement_gpu.py runs it on two GPUs): a single-rank
    model and a TP pair fill the budget exactly as the group is counted (every shard on the CPU, the largest per
    device on CUDA); a PP pair evicts the idle pair, whose rank stops; a size the heads cannot split is refused
    before any process starts or anything is evicted."""
    before = children()
    whole = estimate_weight_bytes(_engine(llama, device=device))
    shards = rank_weight_bytes(_engine(llama, tp=2, device=device))
    counted = group_weight_bytes(shards, device)
    # room for what each keeps beside its weights and one step peak (the estimates, twice over); once both are
    # loaded the budget is narrowed to what they measured to take, so that it is full
    overhead, step_peak = estimate_costs(_engine(llama, device=device), None)
    beside = 2 * (2 * overhead + step_peak)
    results = []
    host = ModelHost(_engine("", device=device), hold_finished_kv=False, pool=KVPool(4 << 20, device),
                     weights_budget=whole + counted + beside, configured_paths={n: llama for n in ("one", "tp", "pp", "odd")},
                     report=results.append, parallel_sizes={"tp": (2, 1), "pp": (1, 2), "odd": (3, 1)})
    host.hooks = Hooks()
    try:
        run(host, _load("one"), _load("tp"))
        assert all(r.ok and not r.evicted for r in results), results
        assert host.weights_used == whole + counted and host.budget_used <= host.weights_budget
        assert host.overhead_used == sum(s.overhead_bytes for s in host.slots.values()) + host.step_reserve > 0
        host.weights_budget = host.budget_used
        want = generate(host, "one")
        assert generate(host, "tp") == want
        status = {s.instance: s for s in host.status()}["tp"]
        assert (status.tensor_parallel_size, status.pipeline_parallel_size) == (2, 1)
        assert status.weight_bytes == counted and host.slots["tp"].rank_weight_bytes == shards
        assert shards[0] == host.slots["tp"].core.weight_bytes  # the estimate is what rank 0 loaded
        devices = [str(rank_device(device, r)) for r in range(2)]
        assert [(r.rank, r.device, r.weight_bytes) for r in status.ranks] == list(zip((0, 1), devices, shards, strict=True))
        assert status.ranks[0].pid == os.getpid() and status.ranks[1].pid in children() - before

        host.hooks.in_use = {"one"}  # busy: the idle pair is what a load nobody waits for may evict
        host.slots["tp"].last_used -= 10
        run(host, _load("pp"))  # a pipeline of two stages, in the room the pair leaves
        assert results[-1].ok and results[-1].evicted == ["tp"], results[-1]
        assert status.ranks[1].pid not in children()
        assert generate(host, "pp") == want
        status = {s.instance: s for s in host.status()}["pp"]
        assert (status.pipeline_parallel_size, [r.device for r in status.ranks]) == (2, devices)

        full = ControlCommand(command_id=f"load-tp-{time.monotonic_ns()}", op="load", name="tp", evict=False)
        run(host, full)
        counts = "its largest shard" if device.startswith("cuda") else "its shards"
        assert not results[-1].ok and f"of weights (tensor_parallel_size 2: {counts}) (free" in results[-1].error

        started = children()
        run(host, _load("odd"))
        assert not results[-1].ok
        assert "tensor_parallel_size 3 does not divide the attention heads 4" in results[-1].error
        assert children() == started and sorted(host.slots) == ["one", "pp"]  # no process, no eviction
    finally:
        host.hooks.in_use = set()
        for inst in list(host.slots):
            host.unload_now(inst)
    assert children() == before


def test_a_group_never_counts_as_the_shared_copy_of_its_model(llama, tmp_path):
    """Worker processes on one device map one shared copy of a single-rank model; a group's ranks load their
    own shards, so the copy already on the device does not make the group free."""
    from kvrelay.shared.worker.shared_weights import SharedWeights

    whole, shards = estimate_weight_bytes(_engine(llama)), rank_weight_bytes(_engine(llama, tp=2))
    results = []
    host = ModelHost(_engine(""), hold_finished_kv=False, pool=KVPool(4 << 20, "cpu"),
                     weights_budget=whole + (max(shards) + sum(shards)) // 2, configured_paths={"one": llama, "tp": llama},
                     report=results.append, parallel_sizes={"tp": (2, 1)}, shared=SharedWeights("cpu", tmp_path / "shm"))
    host.hooks = Hooks()
    try:
        run(host, _load("one"))
        assert host.shared.how("one")  # exported: on the device for any other process
        host.slots["one"].last_used -= 10
        run(host, _load("tp"))
        assert results[-1].ok and results[-1].evicted == ["one"], results[-1]
        assert host.weights_used == sum(shards)
    finally:
        for inst in list(host.slots):
            host.unload_now(inst)
        host.shared.close()
