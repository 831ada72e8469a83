"""Quantization under tensor and pipeline parallelism, in real rank processes over gloo (CPU, fp32):
int8 and fp8 weights split over TP 2 give the greedy tokens of the same quantization on one rank (their
column-parallel rows cut with their scales, their row-parallel inputs cut after quantizing); an fp8 KV
cache on TP 2 and PP 2 ranks, handed off between the two layouts as fp8 bytes, gives one rank's fp8-KV
tokens, and KV of another dtype is refused; AWQ and GPTQ split over TP 2 (cut after unpacking) or PP 2 give
one rank's tokens, and GPTQ's act-order under TP is one line naming both settings."""

import json
import math

import pytest
import torch

from kvrelay import LLM, SamplingParams
from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig
from kvrelay.shared.engine.engine_core import EngineCore
from kvrelay.shared.engine.quant.checkpoint import quantize_checkpoint
from kvrelay.shared.engine.ranks.checks import rank_weight_bytes
from tests.conftest import random_prompts
from tests.kv_scale_checkpoint import self_attn_scales, with_kv_scales
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


def test_tp2_fp8_checkpoint_equals_tp1(tiny_model_dirs, tmp_path):
    """A pre-quantized FP8 checkpoint: each rank cuts the per-channel weight_scale of q, k, v, gate and up
    to its own heads and rows, as it cuts the weights (qwen2: q|k|v biases beside them)."""
    ckpt = quantize_checkpoint(tiny_model_dirs["qwen2"], tmp_path / "fp8", "fp8", group_size=32)
    assert greedy(ckpt, tensor_parallel_size=2) == greedy(ckpt)


def test_pp2_awq_checkpoint_equals_one_rank(tiny_model_dirs, tmp_path):
    """A stage holds whole layers, so a 4-bit checkpoint loads on stages as it does on one rank."""
    ckpt = quantize_checkpoint(tiny_model_dirs["llama"], tmp_path / "awq", "awq", group_size=32)
    assert greedy(ckpt, pipeline_parallel_size=2) == greedy(ckpt)


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 1)])
def test_quantized_ranks_read_the_checkpoints_kv_scales(tiny_model_dirs, tmp_path, tp, pp):
    """int8 weights and an fp8 KV cache over two pipeline stages or tensor-parallel ranks: rank 1's layers
    (its heads of every layer) divide by the checkpoint's scales for their layer, not another's or 1.0, so
    the logprobs are one rank's."""
    dst = with_kv_scales(tiny_model_dirs["llama"], tmp_path / "kv-scales",
                         self_attn_scales({0: (0.37, 0.61), 1: (2.3, 0.53)}))
    scored = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, prompt_logprobs=2)
    got = []
    for split in (dict(), dict(tensor_parallel_size=tp, pipeline_parallel_size=pp)):
        with LLM(model=str(dst), dtype="float32", max_model_len=128, block_size=8, quantization="int8",
                 kv_cache_dtype="fp8", **split) as llm:
            got.append(llm.generate({"prompt_token_ids": PROMPTS[1]}, scored)[0])
    one, two = got
    assert one.outputs[0].token_ids == two.outputs[0].token_ids
    for pos_one, pos_two in zip(one.prompt_logprobs[1:] + one.outputs[0].logprobs,
                                two.prompt_logprobs[1:] + two.outputs[0].logprobs, strict=True):
        assert pos_one.keys() == pos_two.keys()
        for tok in pos_one:
            assert math.isclose(pos_one[tok].logprob, pos_two[tok].logprob, abs_tol=1e-4)


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


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_tp2_four_bit_checkpoint_equals_tp1(tiny_model_dirs, tmp_path, method):
    """AWQ and GPTQ cut after unpacking: q, k, v, gate and up by output columns with their scales and zero
    points, o and down by whole groups of inputs (the tiny llama's o_proj shard has exactly one group)."""
    ckpt = quantize_checkpoint(tiny_model_dirs["llama"], tmp_path / method, method, group_size=32)
    assert greedy(ckpt, tensor_parallel_size=2) == greedy(ckpt)


def test_gptq_act_order_under_tp_is_one_line_naming_both_settings(tiny_model_dirs, tmp_path):
    ckpt = quantize_checkpoint(tiny_model_dirs["llama"], tmp_path / "gptq", "gptq", group_size=32)
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^quantization gptq with act-order \(desc_act\) does not support "
                                         r"tensor_parallel_size 2: "):
        LLM(model=str(ckpt), tensor_parallel_size=2)


def test_a_quantized_groups_shards_weigh_their_quantized_bytes(tiny_model_dirs):
    """Placement and eviction count each rank's shard as it loads: quantized projections in their bytes."""
    def shards(quantization: str | None) -> list[int]:
        return rank_weight_bytes(EngineConfig(ModelConfig(str(tiny_model_dirs["llama"]), dtype="float32",
                                                          quantization=quantization), device="cpu",
                                              tensor_parallel_size=2, pipeline_parallel_size=2))
    full, int8 = shards(None), shards("int8")
    assert len(int8) == 4 and all(q < f for q, f in zip(int8, full, strict=True))
