"""Pipeline parallelism in real processes over gloo: two stages (rank 0 holds the embedding and layer 0,
rank 1 layer 1, the final norm and the LM head) give HF transformers' greedy tokens (fp32) and one
process's on llama (GQA, untied head), gpt2 and bloom (tied), and the same logprobs; a stage killed with -9
makes the engine raise promptly and leaves no process behind; two stages of two tensor-parallel ranks each
give HF's tokens too; stage counts the model cannot split fail before anything starts."""

import pytest
import torch

from kvrelay import LLM, SamplingParams
from tests.conftest import random_prompts
from tests.parity import hf_greedy
from tests.unit.parallel_ranks import (
    MAX_NEW,
    check_a_killed_rank_ends_the_engine,
    check_swap_preemption_equals_hf,
    check_two_ranks_equal_hf_and_one,
    parallel_llm,
)
from tests.unit.parallel_ranks import children as _children

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _llm(model_dir, pp: int, **kwargs) -> LLM:
    return parallel_llm(model_dir, pipeline_parallel_size=pp, **kwargs)


def _stage_0_holds_its_own_layer_only(core) -> None:
    assert core.runner.kv_cache.shape[0] == 1
    assert len(core.runner.ranks.pids) == 1


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bloom"])
def test_pp2_greedy_equals_hf_and_pp1(tiny_model_dirs, arch):
    check_two_ranks_equal_hf_and_one(tiny_model_dirs[arch], "pipeline_parallel_size", _stage_0_holds_its_own_layer_only)


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
    check_swap_preemption_equals_hf(tiny_model_dirs["smollm2"], "pipeline_parallel_size")


def test_killed_stage_fails_the_engine_promptly_and_leaves_no_process(tiny_model_dirs):
    before = _children()
    check_a_killed_rank_ends_the_engine(_llm(tiny_model_dirs["llama"], 2), "pipeline", before)


def test_stage_counts_the_model_cannot_split_fail_before_any_process_starts(tiny_model_dirs):
    before = _children()
    # the tiny models have 2 layers
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds the model's 2 layers: a stage would "
                                         "hold no layers"):
        _llm(tiny_model_dirs["gpt2"], 3)
    with pytest.raises(ValueError, match="argument --pipeline-parallel-size: Input should be greater than or equal to 1"):
        _llm(tiny_model_dirs["llama"], 0)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the attention heads 4"):
        _llm(tiny_model_dirs["llama"], 2, tensor_parallel_size=3)
    assert _children() == before


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the devices")
def test_more_stages_than_cuda_devices_fails_before_anything_loads(tiny_model_dirs):
    with pytest.raises(ValueError, match="pipeline_parallel_size 2 needs CUDA devices 0..1; this machine has"):
        _llm(tiny_model_dirs["llama"], 2, device="cuda")
