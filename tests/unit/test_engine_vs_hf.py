"""Greedy tokens from our engine equal HF transformers ``generate`` on the same weights, for every
architecture, through chunked prefill, prefix caching and forced preemption (recompute and swap)."""

import pytest

from kvrelay import LLM, SamplingParams
from tests.conftest import ARCHS, random_prompts
from tests.parity import engine_greedy, hf_greedy

MAX_NEW = 12


def _shared_prefix_prompts() -> list[list[int]]:
    base = random_prompts(3, lo=20, hi=40, seed=7)
    tails = random_prompts(9, lo=1, hi=20, seed=8)
    return [base[i % 3] + tails[i] for i in range(9)]


MODES = {
    "chunked": dict(enable_chunked_prefill=True, max_num_batched_tokens=32, enable_prefix_caching=False),
    "unchunked": dict(enable_chunked_prefill=False, enable_prefix_caching=False),
    "prefix_cache": dict(enable_chunked_prefill=True, max_num_batched_tokens=64, enable_prefix_caching=True,
                         block_size=8),
    "preempt_recompute": dict(block_size=8, num_gpu_blocks=20, max_num_batched_tokens=48),
    "preempt_swap": dict(block_size=8, num_gpu_blocks=20, max_num_batched_tokens=48, swap_space=0.001),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_hf(tiny_model_dirs, arch, mode):
    prompts = _shared_prefix_prompts() if mode == "prefix_cache" else random_prompts(10, lo=3, hi=60, seed=1)
    expected = hf_greedy(str(tiny_model_dirs[arch]), tuple(map(tuple, prompts)), MAX_NEW)
    got = engine_greedy(LLM(model=str(tiny_model_dirs[arch]), dtype="float32", max_model_len=128, **MODES[mode]),
                        prompts, MAX_NEW)
    assert got == expected


def test_prefix_cache_is_hit(tiny_model_dirs):
    llm = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", max_model_len=128, block_size=8)
    prompt = random_prompts(1, lo=40, hi=40, seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    first = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    second = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 32  # 4 full blocks of 8; the last token is always recomputed
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_preemption_really_happens(tiny_model_dirs):
    llm = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", max_model_len=128, block_size=8,
              num_gpu_blocks=20)
    preempted = 0

    class CountPreemptions:
        def on_step(self, started, out, finished) -> None:
            nonlocal preempted
            preempted += len(out.preempted)

        def on_removed(self, requests) -> None:
            pass

    llm.engine.core.observer = CountPreemptions()
    llm.generate([{"prompt_token_ids": p} for p in random_prompts(10, lo=30, hi=60, seed=1)],
                 SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    assert preempted > 0
