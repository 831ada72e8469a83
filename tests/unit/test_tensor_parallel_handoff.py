"""The KV handoff's engine seam across parallel layouts, in real rank processes over gloo: a prefill
engine's KV leaves as full-head blocks (gathered from its ranks) and lands in a decode engine of
another layout (scattered to its ranks), and the decode engine continues with the greedy tokens one
rank gives on its own, for prefill TP 2 -> decode TP 1 and TP 1 -> TP 2 on the tiny llama (GQA)."""

import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig
from kvrelay.shared.engine.engine_core import EngineCore
from tests.conftest import random_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
MAX_NEW = 8


def _config(model_dir, tp: int, device: str) -> EngineConfig:
    return EngineConfig(ModelConfig(str(model_dir), dtype="float32", max_model_len=128),
                        cache=CacheConfig(block_size=8, num_gpu_blocks=64), device=device, tensor_parallel_size=tp)


def handed_off(prefill: EngineCore, decode: EngineCore, prompts: list[list[int]]) -> list[list[int]]:
    tokens = {}
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        prefill.add_request(prefill.make_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1), None))
        outs = []
        while prefill.has_unfinished():
            outs += [o for o in prefill.step() if o.request_id == rid]
        (first,) = outs
        blocks = decode.kv.reserve(rid, len(prompt))
        full = prefill.kv.export_blocks(prefill.kv.block_ids(rid)[:len(blocks)])
        assert full.shape[4] == 2  # every KV head of the model, whatever the prefill's layout
        assert full.shape[0] == prefill.kv.num_layers  # and every layer, whatever its stages
        decode.kv.import_blocks(blocks, full)
        prefill.kv.release_held(rid)
        decode.add_remote_prefilled(decode.make_request(rid, prompt, SamplingParams(temperature=0.0,
                                                        max_tokens=MAX_NEW), None), first.new_token_ids[0], 0)
        tokens[rid] = list(first.new_token_ids)
    while decode.has_unfinished():
        for o in decode.step():
            tokens[o.request_id] += o.new_token_ids
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def handoffs_across_layouts_continue_like_one_rank(model, device: str) -> None:
    """Prefill TP 2 -> decode TP 1 and TP 1 -> TP 2 give the greedy tokens of one rank (tests/gpu runs it on CUDA)."""
    prompts = random_prompts(3, lo=5, hi=40, seed=4)
    with LLM(model=str(model), dtype="float32", max_model_len=128, block_size=8, device=device) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                             SamplingParams(temperature=0.0, max_tokens=MAX_NEW))]
    for prefill_tp, decode_tp in ((2, 1), (1, 2)):
        prefill = EngineCore(_config(model, prefill_tp, device), hold_finished_kv=True)
        decode = EngineCore(_config(model, decode_tp, device))
        try:
            assert prefill.kv.sharded == (prefill_tp > 1) and decode.kv.sharded == (decode_tp > 1)
            got = handed_off(prefill, decode, prompts)
        finally:
            prefill.shutdown()
            decode.shutdown()
        assert got == want, f"prefill TP {prefill_tp} -> decode TP {decode_tp}"


def test_kv_regrouped_between_tp2_and_tp1_continues_like_one_rank(tiny_model_dirs):
    # 4 attention heads, 2 KV heads: one KV head per rank at TP 2
    handoffs_across_layouts_continue_like_one_rank(tiny_model_dirs["llama"], "cpu")
