"""Async scheduling on a GPU (shared/engine/async_step.py): the next step's input ids come from the previous
step's sampled ids on the device, through CUDA graphs and eager steps; greedy tokens equal HF transformers
(fp32) and every output equals the synchronous engine's, with seeded sampling, stops and n > 1 in the batch.

``pytest -m gpu tests/gpu``; skips without CUDA. tests/unit/test_async_scheduling.py covers the mix on CPU.
"""

import pytest
import torch

from kvrelay import LLM, SamplingParams
from tests.conftest import random_prompts
from tests.parity import engine_greedy, hf_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _llm(model_dir, eager: bool, async_scheduling: bool) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", max_model_len=128, num_gpu_blocks=512, device="cuda",
               max_num_seqs=16, enforce_eager=eager, async_scheduling=async_scheduling)


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_async_greedy_equals_hf(tiny_model_dirs, eager):
    prompts = random_prompts(13, lo=3, hi=60, seed=5)  # 13 pads into the 16 bucket; EOS shrinks the batch
    expected = hf_greedy(str(tiny_model_dirs["llama"]), tuple(map(tuple, prompts)), 16)
    llm = _llm(tiny_model_dirs["llama"], eager, async_scheduling=True)
    assert engine_greedy(llm, prompts, 16) == expected
    assert llm.engine.core.runner.graphs is None or llm.engine.core.runner.graphs.num_replays > 0


def test_async_outputs_equal_sync_with_sampling_and_stops(tiny_model_dirs):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(10, lo=5, hi=40, seed=7)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=20 + i, n=2 if i % 3 == 0 else 1,
                             stop_token_ids=[17] if i % 2 else None, logprobs=2 if i == 4 else None)
              for i in range(len(prompts))]
    runs = []
    for async_scheduling in (False, True):
        llm = _llm(tiny_model_dirs["llama"], eager=False, async_scheduling=async_scheduling)
        outs = llm.generate(prompts, params)
        runs.append([[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs])
        del llm
    assert runs[0] == runs[1]


def test_async_scheduling_is_the_default_on_cuda_except_for_a_prefill_engine(tiny_model_dirs):
    from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig
    from kvrelay.shared.engine.engine_core import EngineCore

    llm = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", max_model_len=128, num_gpu_blocks=64, device="cuda")
    assert llm.engine.core.stepper is not None
    config = EngineConfig(ModelConfig(str(tiny_model_dirs["llama"]), dtype="float32", max_model_len=128),
                          cache=CacheConfig(num_gpu_blocks=64), device="cuda")  # not 0.9 of a GPU the suite shares
    assert EngineCore(config, hold_finished_kv=True).stepper is None  # a prefill worker's engine
