"""``n > 1`` through the offline API on a tiny model: the children compute their shared prompt once (the
others only the partial last block), and their tokens are those of independent requests with the same
seeds, with prefix caching on or off."""

import pytest

from kvrelay import LLM, SamplingParams
from tests.conftest import random_prompts

BLOCK = 8
N = 8


def _llm(tiny_model_dirs, prefix: bool) -> LLM:
    return LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", max_model_len=128, block_size=BLOCK,
               enable_prefix_caching=prefix, max_num_batched_tokens=64)


def _count_prompt_tokens(llm: LLM) -> list[int]:
    """Prompt tokens each step computes, read from the scheduler's outputs as they are made."""
    sched = llm.engine.core.scheduler
    schedule, counted = sched.schedule, [0]

    def counting(*args, **kwargs):
        out = schedule(*args, **kwargs)
        for s in out.scheduled:
            r = s.request
            counted[0] += max(0, min(r.num_computed_tokens + s.num_new_tokens, r.num_prompt_tokens)
                              - r.num_computed_tokens)
        return out

    sched.schedule = counting
    return counted


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_n_children_compute_the_prompt_once_with_the_same_tokens(tiny_model_dirs, temperature):
    prompt = random_prompts(1, lo=30, hi=30, seed=77)[0]  # 3 full blocks and 6 tokens
    assert len(prompt) == 30
    params = SamplingParams(n=N, temperature=temperature, seed=1234, max_tokens=6, ignore_eos=True)

    llm = _llm(tiny_model_dirs, prefix=True)
    counted = _count_prompt_tokens(llm)
    shared = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    assert counted[0] == len(prompt) + (N - 1) * (len(prompt) % BLOCK)

    # the same children as independent requests, one at a time, on an engine that caches nothing
    plain = _llm(tiny_model_dirs, prefix=False)
    counted_plain = _count_prompt_tokens(plain)
    alone = [plain.generate([{"prompt_token_ids": prompt}],
                            SamplingParams(temperature=temperature, seed=1234 + i, max_tokens=6, ignore_eos=True)
                            )[0].outputs[0].token_ids for i in range(N)]
    assert [o.token_ids for o in shared.outputs] == alone
    # n > 1 without prefix caching: nothing is held, every child computes the prompt
    together = plain.generate([{"prompt_token_ids": prompt}], params)[0]
    assert [o.token_ids for o in together.outputs] == alone
    assert counted_plain[0] == 2 * N * len(prompt)
