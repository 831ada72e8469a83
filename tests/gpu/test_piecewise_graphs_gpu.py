"""Piecewise CUDA graphs on a GPU (``--cudagraph-mode FULL_AND_PIECEWISE``, shared/engine/piecewise_graphs.py):
steps holding prompt tokens replay captured pieces around eager attention. Greedy tokens equal HF transformers
(fp32, tiny random models) while prompts of different lengths arrive in chunks beside decoding ones; bf16 prompt
logprobs agree with the eager engine's; a mixed step still syncs only to read its sampled ids; a model the
pieces do not cover keeps decode graphs. tests/gpu/test_warmup_gpu.py checks nothing captures after warm-up.

``pytest -m gpu tests/gpu/test_piecewise_graphs_gpu.py`` on a CUDA machine; skips without CUDA.
"""

import logging

import pytest
import torch

from kvrelay import LLM, SamplingParams
from tests.conftest import random_prompts
from tests.gpu.test_decode_graphs import _syncs_in_one_step
from tests.parity import engine_greedy, hf_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MAX_NEW = 16
# a 32-token step budget and 4 sequences: later prompts arrive in chunks while earlier ones decode
MIXED = dict(enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=4)


def _llm(model_dir, mode: str, dtype: str = "float32", **kwargs) -> LLM:
    # a fixed, small KV cache: the default would take 90% of the GPU for a 64-wide model
    return LLM(model=str(model_dir), dtype=dtype, max_model_len=128, num_gpu_blocks=512, device="cuda",
               cudagraph_mode=mode, **kwargs)


@pytest.mark.parametrize("arch, prefix_cache", [("llama", False), ("llama", True), ("qwen2", False)])
def test_mixed_steps_through_pieces_equal_hf(tiny_model_dirs, arch, prefix_cache):
    model_dir = tiny_model_dirs[arch]
    prompts = random_prompts(10, lo=3, hi=70, seed=21)
    if prefix_cache:
        shared = random_prompts(1, lo=32, hi=32, seed=99)[0]  # 4 full blocks of 8
        prompts = [shared + p[:40] for p in prompts]
    expected = hf_greedy(str(model_dir), tuple(map(tuple, prompts)), MAX_NEW)
    llm = _llm(model_dir, "FULL_AND_PIECEWISE", enable_prefix_caching=prefix_cache, block_size=8, **MIXED)
    runner = llm.engine.core.runner
    pieces = runner.piecewise
    assert pieces is not None and runner.graphs is not None
    assert pieces.sizes == [8, 12, 16, 24, 32]
    assert len(pieces._graphs) == len(pieces.sizes) * (runner.model.num_layers + 1)
    assert engine_greedy(llm, prompts, MAX_NEW) == expected
    if prefix_cache:  # again, over the cached prefix blocks
        assert engine_greedy(llm, prompts, MAX_NEW, min_cached_tokens=32 * len(prompts)) == expected
    assert pieces.num_replays > 0 and len(pieces.replays_by_bucket) > 1  # several buckets replayed
    assert runner.graphs.num_replays > 0  # decode-only steps still replay the whole-step graphs


def test_bf16_prompt_logprobs_agree_with_eager(tiny_model_dirs):
    # prompt logprobs are read off the very rows the pieces compute (every prompt row of every chunk)
    prompts = random_prompts(8, lo=20, hi=90, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1)
    runs = []
    for mode in ("FULL_AND_PIECEWISE", "NONE"):
        llm = _llm(tiny_model_dirs["llama"], mode, dtype="bfloat16", **MIXED)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        runs.append([[pos[t].logprob for pos, t in zip(o.prompt_logprobs[1:], p[1:], strict=True)]
                     for o, p in zip(outs, prompts, strict=True)])
        runner = llm.engine.core.runner
        assert (runner.piecewise is not None) == (runner.graphs is not None) == (mode != "NONE")  # NONE: no graphs
    got, want = (torch.tensor(sum(r, [])) for r in runs)
    diff = (got - want).abs()
    print(f"bf16 prompt logprobs, piecewise vs eager: max |diff| {diff.max():.4f}, mean {diff.mean():.5f}")
    assert diff.mean() < 0.02 and diff.max() < 0.25  # bf16 rounding of a padded vs unpadded GEMM, not a wrong row


def test_a_mixed_step_syncs_once(tiny_model_dirs):
    llm = _llm(tiny_model_dirs["llama"], "FULL_AND_PIECEWISE", async_scheduling=False, **MIXED)
    core = llm.engine.core
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    core.add_request(core.make_request("a", random_prompts(1, lo=5, hi=5, seed=1)[0], params))
    assert _syncs_in_one_step(core) == 1  # a prompt of 5: a piecewise step
    core.add_request(core.make_request("b", random_prompts(1, lo=20, hi=20, seed=2)[0], params))
    replays = core.runner.piecewise.num_replays
    assert _syncs_in_one_step(core) == 1  # a decode beside a prompt of 20
    assert core.runner.piecewise.num_replays == replays + 1


def test_a_model_the_pieces_do_not_cover_keeps_decode_graphs(tiny_model_dirs, caplog):
    prompts = random_prompts(6, lo=3, hi=40, seed=4)
    expected = hf_greedy(str(tiny_model_dirs["gpt2"]), tuple(map(tuple, prompts)), MAX_NEW)
    with caplog.at_level(logging.INFO, logger="kvrelay.shared.engine.piecewise_graphs"):
        llm = _llm(tiny_model_dirs["gpt2"], "FULL_AND_PIECEWISE", **MIXED)
    assert "run eagerly (GPT2LMHeadModel is not of the Llama family)" in caplog.text
    runner = llm.engine.core.runner
    assert runner.piecewise is None and runner.graphs is not None
    assert engine_greedy(llm, prompts, MAX_NEW) == expected
