"""Weight accounting of quantized models (shared/worker/model_memory.py, model_host.py): the estimate a
worker budgets with is the bytes the quantized model really holds, so a weights budget that fits one
full-precision model fits two quantized ones; and the quantization travels per model in the load command
(the admin API's and the multi-model config's ``quantization``)."""

from kvrelay.shared.config.engine import EngineConfig, ModelConfig
from kvrelay.shared.worker.model_memory import estimate_weight_bytes
from tests.unit.test_model_host import load, make_host, repo, run  # noqa: F401  (repo: the module fixture)


def held_bytes(host, instance: str) -> int:
    return host.slots[instance].core.weight_bytes


def test_quantized_models_are_budgeted_at_their_quantized_size(repo):  # noqa: F811
    host, results = make_host(repo, models_that_fit=1.5)
    run(host, load("a", quantization="int8"))
    run(host, load("b", quantization="fp8"))
    assert all(r.ok and not r.evicted for r in results), results
    assert sorted(host.slots) == ["a@1", "b@1"]
    for inst in ("a@1", "b@1"):
        assert host.slots[inst].weight_bytes == held_bytes(host, inst)
    full = estimate_weight_bytes(EngineConfig(model=ModelConfig(model=repo.get("a", 1).path, dtype="float32"),
                                              device="cpu"))
    assert host.slots["a@1"].weight_bytes < 0.7 * full


def test_the_same_budget_holds_one_full_precision_model(repo):  # noqa: F811
    host, results = make_host(repo, models_that_fit=1.5)
    run(host, load("a"))
    host.slots["a@1"].last_used -= 10
    run(host, load("b"))
    assert results[-1].ok and results[-1].evicted == ["a@1"] and sorted(host.slots) == ["b@1"]


def test_a_dummy_four_bit_model_is_budgeted_packed():
    config = EngineConfig(model=ModelConfig(model="dummy:llama-3-8b", dtype="bfloat16", quantization="awq",
                                                   load_format="dummy"),
                          device="cpu")
    awq = estimate_weight_bytes(config)
    bf16 = estimate_weight_bytes(EngineConfig(model=ModelConfig(model="dummy:llama-3-8b", dtype="bfloat16"),
                                              device="cpu"))
    # 8.0 B parameters; 7.0 B of them in projections at 4 bits + fp16 scales and uint8 zeros per 128
    assert 5.0e9 < awq < 5.8e9 and 15.5e9 < bf16 < 16.5e9
