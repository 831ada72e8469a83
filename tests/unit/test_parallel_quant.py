"""Quantization under tensor and pipeline parallelism, in real rank processes over gloo (CPU, fp32):
int8 and fp8 weights split over TP 2 give the greedy tokens of the same quantization on one rank (their
column-parallel rows cut with their scales, their row-parallel inputs cut after quantizing); an fp8 KV
cache on TP 2 and PP 2 ranks, handed off between the two layouts as fp8 bytes, gives one rank's fp8-KV
tokens, and KV of another dtype is refused; the 4-bit formats under TP are one line naming both settings."""

import pytest
import torch

from kvrelay import LLM, SamplingParams
from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig
from kvrelay.shared.engine.engine_core import EngineCore
from tests.conftest import random_prompts
from tests.unit.test_tensor_parallel_handoff import MAX_NEW, handed_off

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PROMPTS = random_prompts(4, lo=3, hi=40, seed=5)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def greedy(model_dir, **kwargs) -> list[list[int]]:
    with LLM(model=str(model_dir), dtype="float32", max_model_len=128, block_size=8, **kwargs) as llm:
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


@pytest.mark.parametrize(("arch", "method"), [("llama", "int8"), ("llama", "fp8"), ("gpt2", "int8")])
def test_tp2_quantized_equals_tp1(tiny_model_dirs, arch, method):
    one = greedy(tiny_model_dirs[arch], quantization=method)
    assert greedy(tiny_model_dirs[arch], quantization=method, tensor_parallel_size=2) == one


def _config(model_dir, tp: int = 1, pp: int = 1) -> EngineConfig:
    return EngineConfig(ModelConfig(str(model_dir), dtype="float32", max_model_len=128),
                        cache=CacheConfig(block_size=8, num_gpu_blocks=64, kv_cache_dtype="fp8"), device="cpu",
                        tensor_parallel_size=tp, pipeline_parallel_size=pp)


def test_fp8_kv_on_tp2_and_pp2_ranks_hands_off_as_fp8(tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    want = greedy(model, kv_cache_dtype="fp8")
    prefill = EngineCore(_config(model, tp=2), hold_finished_kv=True)
    decode = EngineCore(_config(model, pp=2))
    try:
        assert prefill.kv.sharded and decode.kv.sharded
        assert handed_off(prefill, decode, PROMPTS) == want  # TP 2's fp8 blocks decoded by PP 2's stages
        rid = "check"
        prefill.add_request(prefill.make_request(rid, PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=1),
                                                 None))
        while prefill.has_unfinished():
            prefill.step()
        full = prefill.kv.export_blocks(prefill.kv.block_ids(rid))
        assert full.dtype == torch.float8_e4m3fn  # the bytes as the ranks hold them, not widened
        blocks = decode.kv.reserve(rid, len(PROMPTS[0]))
        with pytest.raises(ValueError, match="KV of dtype torch.float32 for a cache of torch.float8_e4m3fn"):
            decode.kv.import_blocks(blocks, full[:, :, :len(blocks)].float())
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_four_bit_under_tp_is_one_line_naming_both_settings():
    with pytest.raises(ValueError, match=r"^quantization awq does not support tensor_parallel_size 2 yet: "):
        LLM(model="dummy:tiny-llama", quantization="awq", tensor_parallel_size=2)
