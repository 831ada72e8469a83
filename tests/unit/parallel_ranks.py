"""What the tensor- and pipeline-parallel engine tests share: this process's live children, the engine they
build, the checks that two ranks give HF's greedy tokens and one rank's logprobs and that swap preemption
keeps HF's tokens, and the check that a rank killed with -9 mid-generation ends the engine promptly, for
good, and leaves no process."""

import math
import os
import signal
import time
from collections.abc import Callable

import psutil
import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.shared.engine.ranks.group import TensorParallelError
from tests.conftest import random_prompts
from tests.parity import hf_greedy

MAX_NEW = 10


def parallel_llm(model_dir, **kwargs) -> LLM:
    # chunked prefill with a small budget: mixed prefill + decode steps, and steps that form no logits
    return LLM(model=str(model_dir), dtype="float32", max_model_len=128, max_num_batched_tokens=32, **kwargs)


def check_two_ranks_equal_hf_and_one(model_dir, size: str, on_two: Callable[[object], None] | None = None) -> None:
    """``size``: the LLM argument set to 1, then 2 ("tensor_parallel_size", "pipeline_parallel_size"); both
    give HF's greedy tokens and free every KV block, and their logprobs agree. ``on_two(core)``: more checks
    of the two-rank engine."""
    prompts = random_prompts(6, lo=3, hi=50, seed=1)
    expected = hf_greedy(str(model_dir), tuple(map(tuple, prompts)), MAX_NEW)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    scored = SamplingParams(temperature=0.0, max_tokens=3, logprobs=3, prompt_logprobs=2)
    got = {}
    for n in (1, 2):
        with parallel_llm(model_dir, block_size=8, **{size: n}) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
            core = llm.engine.core
            assert core.num_free_blocks == core.num_total_blocks, "KV blocks leaked"
            got[n] = ([o.outputs[0].token_ids for o in outs],
                      llm.generate({"prompt_token_ids": prompts[2]}, scored)[0])
            if n == 2 and on_two is not None:
                on_two(core)
    assert got[2][0] == expected
    assert got[1][0] == expected
    one, two = got[1][1], got[2][1]
    for pos_one, pos_two in zip(one.prompt_logprobs[1:] + one.outputs[0].logprobs,
                                two.prompt_logprobs[1:] + two.outputs[0].logprobs, strict=True):
        assert pos_one.keys() == pos_two.keys()
        for tok in pos_one:
            assert math.isclose(pos_one[tok].logprob, pos_two[tok].logprob, abs_tol=1e-4)


def check_swap_preemption_equals_hf(model_dir, size: str) -> None:
    """Two ranks (``size``: as above) with too few KV blocks for the batch, preempting by swap: HF's tokens."""
    prompts = random_prompts(10, lo=30, hi=60, seed=1)
    expected = hf_greedy(str(model_dir), tuple(map(tuple, prompts)), MAX_NEW)
    with parallel_llm(model_dir, block_size=8, num_gpu_blocks=20, swap_space=0.001, **{size: 2}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in outs] == expected


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}


def check_a_killed_rank_ends_the_engine(llm: LLM, kind: str, before: set[int]) -> None:
    """``kind``: "tensor" or "pipeline", as the error names the rank."""
    (pid,) = llm.engine.core.runner.ranks.pids
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    stream = llm.generate_stream([{"prompt_token_ids": p} for p in random_prompts(4, seed=2)], params)
    next(stream)  # the group is mid-generation
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match=f"{kind}-parallel rank 1 of 2 \\(pid {pid}\\) was killed by signal 9"):
        for _ in stream:
            pass
    assert time.monotonic() - started < 30
    with pytest.raises(TensorParallelError, match="the group is down"):  # and it stays down
        llm.generate({"prompt_token_ids": [1, 2, 3]}, params)
    llm.shutdown()
    assert children() == before
