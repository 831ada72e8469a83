"""Pipeline parallelism in real processes over gloo: two stages (rank 0 holds the embedding and layer 0,
rank 1 layer 1, the final norm and the LM head) give HF transformers' greedy tokens (fp32) and one
process's on llama (GQA, untied head), gpt2 and bloom (tied), and the same logprobs; a stage killed with -9
makes the engine raise promptly and leaves no process behind; two stages of two tensor-parallel ranks each
give HF's tokens too; stage counts the model cannot split fail before anything starts."""

import math

import pytest
import torch

from kvrelay import LLM, SamplingParams
from tests.conftest import random_prompts
from tests.parity import hf_greedy
from tests.unit.parallel_ranks import check_a_killed_rank_ends_the_engine
from tests.unit.parallel_ranks import children as _children

MAX_NEW = 10
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _llm(model_dir, pp: int, **kwargs) -> LLM:
    # chunked prefill with a small budget: mixed prefill + decode steps, and steps that form no logits
    return LLM(model=str(model_dir), dtype="float32", max_model_len=128, pipeline_parallel_size=pp,
               max_num_batched_tokens=32, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bloom"])
def test_pp2_greedy_equals_hf_and_pp1(tiny_model_dirs, arch):
    prompts = random_prompts(6, lo=3, hi=50, seed=1)
    expected = hf_greedy(str(tiny_model_dirs[arch]), tuple(map(tuple, prompts)), MAX_NEW)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    scored = SamplingParams(temperature=0.0, max_tokens=3, logprobs=3, prompt_logprobs=2)
    got = {}
    for pp in (1, 2):
        with _llm(tiny_model_dirs[arch], pp, block_size=8) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
            core = llm.engine.core
            assert core.num_free_blocks == core.num_total_blocks, "KV blocks leaked"
            got[pp] = ([o.outputs[0].token_ids for o in outs],
                       llm.generate({"prompt_token_ids": prompts[2]}, scored)[0])
            if pp == 2:  # stage 0 holds and caches its own layer only
                assert core.runner.kv_cache.shape[0] == 1
                assert len(core.runner.ranks.pids) == 1
    assert got[2][0] == expected
    assert got[1][0] == expected
    one, two = got[1][1], got[2][1]
    for pos_one, pos_two in zip(one.prompt_logprobs[1:] + one.outputs[0].logprobs,
                                two.prompt_logprobs[1:] + two.outputs[0].logprobs, strict=True):
        assert pos_one.keys() == pos_two.keys()
        for tok in pos_one:
            assert math.isclose(pos_one[tok].logprob, pos_two[tok].logprob, abs_tol=1e-4)


def test_tp2_x_pp2_greedy_equals_hf(tiny_model_dirs):
    """Four ranks: two stages, each a tensor-parallel pair (GQA heads and the vocabulary sharded within a
    stage); rank 2 sends rank 0 the last stage's logits."""
    prompts = random_prompts(4, lo=3, hi=40, seed=3)
    expected = hf_greedy(str(tiny_model_dirs["llama"]), tuple(map(tuple, prompts)), MAX_NEW)
    before = _children()
    with _llm(tiny_model_dirs["llama"], 2, tensor_parallel_size=2, block_size=8) as llm:
        assert len(llm.engine.core.runner.ranks.pids) == 3
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert _children() == before


def test_pp2_swap_preemption_equals_hf(tiny_model_dirs):
    """Preemption by swap: each stage copies its own layers' blocks out to the host and back."""
    prompts = random_prompts(10, lo=30, hi=60, seed=1)
    expected = hf_greedy(str(tiny_model_dirs["smollm2"]), tuple(map(tuple, prompts)), MAX_NEW)
    with _llm(tiny_model_dirs["smollm2"], 2, block_size=8, num_gpu_blocks=20, swap_space=0.001) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_killed_stage_fails_the_engine_promptly_and_leaves_no_process(tiny_model_dirs):
    before = _children()
    check_a_killed_rank_ends_the_engine(_llm(tiny_model_dirs["llama"], 2), "pipeline", before)


def test_stage_counts_the_model_cannot_split_fail_before_any_process_starts(tiny_model_dirs):
    before = _children()
    # the tiny models have 2 layers
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds the model's 2 layers: a stage would "
                                         "hold no layers"):
        _llm(tiny_model_dirs["gpt2"], 3)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        _llm(tiny_model_dirs["llama"], 0)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the attention heads 4"):
        _llm(tiny_model_dirs["llama"], 2, tensor_parallel_size=3)
    assert _children() == before


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the devices")
def test_more_stages_than_cuda_devices_fails_before_anything_loads(tiny_model_dirs):
    with pytest.raises(ValueError, match="pipeline_parallel_size 2 needs CUDA devices 0..1; this machine has"):
        _llm(tiny_model_dirs["llama"], 2, device="cuda")
