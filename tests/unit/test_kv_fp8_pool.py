"""Capacity with an fp8 KV cache: from the same KV memory a model gets twice the blocks of its bf16 cache
(block bytes from the KV dtype, not the model's), the engine serves a batch that only fits that way,
and what the worker reports (vLLM's cache_config_info on /metrics, the heartbeat's engine stats) says
the fp8 dtype and the doubled count."""

import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay import LLM, SamplingParams
from kvrelay.shared.worker.metrics import WorkerMetrics

KV_BYTES = 4 << 20


def _llm(kv_cache_dtype: str, **kw) -> LLM:
    return LLM(model="dummy:tiny-llama", dtype="bfloat16", kv_cache_memory=KV_BYTES, max_model_len=128,
               kv_cache_dtype=kv_cache_dtype, **kw)


def test_same_memory_holds_twice_the_blocks():
    bf16, fp8 = _llm("auto").engine.core, _llm("fp8").engine.core
    assert bf16.kv_dtype == torch.bfloat16 and fp8.kv_dtype == torch.float8_e4m3fn
    assert fp8.block_bytes * 2 == bf16.block_bytes
    assert fp8.num_total_blocks == 2 * bf16.num_total_blocks == 2 * (KV_BYTES // bf16.block_bytes)
    assert fp8.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert fp8.runner.kv_cache.untyped_storage().nbytes() <= KV_BYTES  # the doubling costs no extra memory
    assert _llm("fp8_e4m3").engine.core.kv_dtype == torch.float8_e4m3fn  # vLLM's other name for it


def test_a_batch_that_needs_the_doubled_pool_runs_at_once():
    """Six sequences growing to 64 tokens (4 blocks each) in the memory of 12 bf16 blocks: with bf16 at
    most 4 run at once (3-block prompts), with fp8 the same bytes are 24 blocks and all 6 run together."""
    block_bytes = _llm("auto").engine.core.block_bytes
    prompts = [{"prompt_token_ids": [3 + i] * 48} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    peaks = {}
    for kv_dtype in ("auto", "fp8"):
        llm = LLM(model="dummy:tiny-llama", dtype="bfloat16", kv_cache_memory=12 * block_bytes, block_size=16,
                  max_model_len=128, kv_cache_dtype=kv_dtype)
        core = llm.engine.core
        for rid, p in enumerate(prompts):
            llm.engine.add_request(p, params, request_id=str(rid))
        peaks[kv_dtype] = 0
        while llm.engine.has_unfinished():
            llm.engine.step()
            peaks[kv_dtype] = max(peaks[kv_dtype], core.num_running)
        assert core.num_free_blocks == core.num_total_blocks == (12 if kv_dtype == "auto" else 24)
    assert peaks == {"auto": 4, "fp8": 6}, peaks


def test_metrics_report_the_fp8_cache():
    core = _llm("fp8").engine.core
    metrics = WorkerMetrics(core, "tiny", "unified", "w1")
    text = generate_latest(metrics.registry).decode()
    info = next(s for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name == "vllm:cache_config_info")
    assert info.labels["cache_dtype"] == "float8_e4m3fn"
    assert info.labels["num_gpu_blocks"] == str(core.num_total_blocks)
    stats = metrics.engine_stats()
    assert stats.cache_dtype == "float8_e4m3fn" and stats.num_gpu_blocks == core.num_total_blocks


def test_a_models_kv_floor_is_counted_in_its_kv_dtype():
    """The KV a co-resident model must keep (one max-length sequence) is what its own cache stores: a worker
    admitting an fp8-KV model next to others reserves half the bf16 bytes for it."""
    from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig
    from kvrelay.shared.worker.model_memory import kv_floor_bytes

    def floor(kv_dtype: str) -> int:
        return kv_floor_bytes(EngineConfig(model=ModelConfig(model="dummy:tiny-llama", dtype="bfloat16", max_model_len=128),
                                           cache=CacheConfig(kv_cache_dtype=kv_dtype), device="cpu"))

    assert floor("fp8") * 2 == floor("auto") > 0
    llm = _llm("fp8")
    core = llm.engine.core
    assert floor("fp8") == -(-core.runner.max_model_len // core.block_size) * core.block_bytes
