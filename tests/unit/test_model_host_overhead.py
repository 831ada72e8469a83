"""What a loaded model keeps besides its weights and KV (its resident overhead) and its step peak: measured by
the engine, counted per model in a worker's budget with one step peak held back, advertised to placement, shown
as a metric (issue #26). CPU: the engine's persistent tensors are counted (the rotary table, the KV scales)."""


import msgpack
import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.gateway.control.placement import _preference
from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig
from kvrelay.shared.engine import EngineCore
from kvrelay.shared.engine.kv_pool import KVPool
from kvrelay.shared.engine.loader import load_model
from kvrelay.shared.repo.model_import import import_model
from kvrelay.shared.repo.model_repo import ModelRepository
from kvrelay.shared.wire import codec
from kvrelay.shared.wire.protocol import InstanceStatus, WorkerInfo
from kvrelay.shared.worker.metrics import WorkerMetrics
from kvrelay.shared.worker.model_host import ModelHost
from kvrelay.shared.worker.model_memory import estimate_weight_bytes
from tests.conftest import make_tiny_model
from tests.unit.test_model_host import load, run


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> ModelRepository:
    root = tmp_path_factory.mktemp("overhead")
    repo = ModelRepository(root / "repo")
    for i, name in enumerate(("a", "b", "c")):
        import_model(repo, str(make_tiny_model("llama", root / name, seed=i)), name, progress=False)
    return repo


def engine_config(path: str) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=path, dtype="float32", max_model_len=64),
                        cache=CacheConfig(block_size=8, kv_cache_memory=1 << 20), device="cpu")


class Hooks:
    def attach(self, slot): ...

    def detach(self, slot): ...

    def idle(self, slot):
        return True

    def may_unload(self, slot):
        return True

    def busy(self, slot):
        return False


def make_host(repo: ModelRepository, budget: int):
    base = EngineConfig(model=ModelConfig(model="", dtype="float32", max_model_len=64),
                        cache=CacheConfig(block_size=8), device="cpu")
    results = []
    host = ModelHost(base, hold_finished_kv=False, pool=KVPool(4 << 20, "cpu"), weights_budget=budget, repo=repo,
                     report=results.append)
    host.hooks = Hooks()
    return host, results


def one_model_bytes(repo: ModelRepository) -> int:
    return estimate_weight_bytes(EngineConfig(model=ModelConfig(model=repo.get("a", 1).path, dtype="float32"),
                                              device="cpu"))


def test_the_engine_counts_its_persistent_buffers_and_one_registered_through_its_model(repo):
    path = repo.get("a", 1).path
    core = EngineCore(engine_config(path))
    rotary = core.runner.model.cos_sin_cache
    scales = core.runner.kv_scales
    assert core.resident_overhead_bytes == rotary.numel() * 4 + scales.numel() * 4 > 0
    assert core.step_peak_bytes == 0  # the CPU's steps are not measured (no allocator reports)
    model, hf = load_model(engine_config(path).model, "cpu")
    model.register_buffer("held_for_the_test", torch.zeros(1000, dtype=torch.float32), persistent=False)
    grown = EngineCore(engine_config(path), loaded=(model, hf))
    assert grown.resident_overhead_bytes == core.resident_overhead_bytes + 4000
    assert grown.weight_bytes == core.weight_bytes  # a buffer is overhead, never weights


def test_a_budget_that_holds_two_models_weights_but_not_their_overhead_loads_one(repo):
    weights = one_model_bytes(repo)
    host, results = make_host(repo, budget=2 * weights + 16)  # two by weights alone; their buffers do not fit
    run(host, load("a"))
    slot = host.slots["a@1"]
    assert results[-1].ok and slot.overhead_bytes == slot.core.resident_overhead_bytes > 16
    assert host.budget_used == weights + slot.overhead_bytes
    run(host, load("b", evict=False))
    assert not results[-1].ok and "not enough memory to load b@1" in results[-1].error
    assert sorted(host.slots) == ["a@1"]
    slot.last_used -= 10  # idle: the next load evicts it instead
    run(host, load("b"))
    assert results[-1].ok and results[-1].evicted == ["a@1"] and sorted(host.slots) == ["b@1"]


def test_the_step_peak_is_held_back_once_not_per_model(repo):
    host, results = make_host(repo, budget=8 << 20)
    run(host, load("a"))
    run(host, load("b"))
    a, b = host.slots["a@1"], host.slots["b@1"]
    a.step_peak_bytes, b.step_peak_bytes = 1000, 3000  # as a CUDA warm-up would have measured them
    assert host.step_reserve == 3000
    assert host.overhead_used == a.overhead_bytes + b.overhead_bytes + 3000
    assert host._kv_cap() == host.pool.base_bytes + 8 * 2**20 - host.weights_used - host.overhead_used


def test_the_heartbeat_and_the_metrics_carry_each_models_overhead(repo):
    host, _ = make_host(repo, budget=8 << 20)
    run(host, load("a"))
    slot = host.slots["a@1"]
    (status,) = [s for s in host.status() if s.instance == "a@1"]
    assert status.overhead_bytes == slot.overhead_bytes > 0
    metrics = WorkerMetrics(slot.core, "a@1", "unified", "w1", process_collectors=False)
    found = {s.name: s.value for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
             for s in f.samples if s.labels.get("model_name") == "a@1"}
    assert found["kvrelay_model_overhead_bytes"] == slot.core.resident_overhead_bytes
    assert found["kvrelay_model_step_peak_bytes"] == 0


def _worker(worker_id: str, **over) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="unified", models=[], zmq_addr="tcp://127.0.0.1:7", free_blocks=0,
                      total_blocks=0, running=0, waiting=0, pid=1, host="h", started=1.0, heartbeat=2.0, can_load=True,
                      weights_budget=10 << 30, weights_used=4 << 30, **over)


def test_placement_takes_the_measured_overhead_out_of_a_workers_free_budget():
    crowded = _worker("crowded", overhead_used=3 << 30)  # the same weights, more kept beside them
    roomy = _worker("roomy", overhead_used=1 << 30)
    assert [w.worker_id for w in sorted([crowded, roomy], key=_preference)] == ["roomy", "crowded"]
    raw = codec.encode(crowded)
    assert codec.decode(raw, WorkerInfo).overhead_used == 3 << 30
    assert "overhead_used" in msgpack.unpackb(raw, raw=False)[codec.IGNORABLE_KEY]  # an older gateway drops it
    status = InstanceStatus(instance="m", name="m", version=0, state="ready", overhead_bytes=5, step_peak_bytes=7)
    assert codec.decode(codec.encode(status), InstanceStatus) == status


def test_the_estimate_before_a_first_load_counts_the_graphs_of_the_mode_in_force():
    """A CUDA model's resident overhead grows with what its graph mode captures (none, decode graphs, decode
    graphs and pieces); its step peak does not; and a measurement under one mode is not reused for another."""
    from kvrelay.shared.worker.model_overhead import estimate_costs, shape_key

    def config(mode: str) -> EngineConfig:
        return EngineConfig(model=ModelConfig(model="dummy:tiny-llama", cudagraph_mode=mode,
                                              enforce_eager=mode == "NONE"), device="cuda:0")

    modes = ("NONE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
    costs = [estimate_costs(config(mode), None) for mode in modes]
    assert costs[0][0] < costs[1][0] < costs[2][0]
    assert costs[0][1] == costs[1][1] == costs[2][1]
    assert len({shape_key(config(mode), None) for mode in modes}) == 3
