"""CUDA-graph decode on a GPU: greedy tokens equal HF transformers (fp32, tiny random models) through
captured graphs and through eager steps, at batch sizes that pad into a bucket, with chunked prefill
and the prefix cache; a decode step's only host sync is reading the sampled ids.

``pytest -m gpu tests/gpu`` on a CUDA machine; everything here skips without CUDA.
"""

import warnings

import pytest
import torch

from kvrelay import LLM, SamplingParams
from kvrelay.shared.engine.cuda_graphs import DecodeGraphs
from tests.conftest import random_prompts
from tests.parity import engine_greedy, hf_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MAX_NEW = 16


def _llm(model_dir, eager: bool, **kwargs) -> LLM:
    # a fixed, small KV cache: the default would take 90% of the GPU for a 64-wide model
    kwargs.setdefault("max_num_seqs", 16)
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128, num_gpu_blocks=512, device="cuda",
              enforce_eager=eager, **kwargs)
    runner = llm.engine.core.runner
    assert (runner.graphs is None) == eager, "graphs must be captured exactly when not eager"
    return llm


def _replays(llm: LLM) -> int:
    graphs = llm.engine.core.runner.graphs
    return 0 if graphs is None else graphs.num_replays


MODES = {
    "plain": dict(enable_prefix_caching=False),
    "chunked": dict(enable_chunked_prefill=True, max_num_batched_tokens=32, enable_prefix_caching=False),
    "prefix_cache": dict(enable_prefix_caching=True, block_size=8),
}


# A covering set, not the whole mode x batch x graphs/eager grid (24 cases, each a model built and an HF reference
# generated): every mode runs with graphs and eagerly, every batch size (1; 3 and 13, which pad into the 4 and 16
# buckets; 8, a full bucket) runs with graphs and eagerly, and each mode meets at least two batch sizes. The modes
# change how prompts reach the cache (whole, in chunks, over cached blocks), the batch size which bucket a decode
# step replays: the whole grid only added pairings of those, while the HF references were most of its time.
LLAMA_CASES = [("plain", 13, False), ("chunked", 8, False), ("prefix_cache", 3, False), ("chunked", 1, False),
               ("plain", 1, True), ("plain", 8, True), ("chunked", 3, True), ("prefix_cache", 13, True)]


@pytest.mark.parametrize("mode, num_prompts, eager", LLAMA_CASES,
                         ids=[f"{m}-{n}-{'eager' if e else 'graphs'}" for m, n, e in LLAMA_CASES])
def test_llama_greedy_equals_hf(tiny_model_dirs, mode, num_prompts, eager):
    # 3 and 13 pad into the 4 and 16 buckets; requests ending at EOS shrink the batch through others
    model_dir = tiny_model_dirs["llama"]
    prompts = random_prompts(num_prompts, lo=3, hi=60, seed=num_prompts)
    if mode == "prefix_cache":
        shared = random_prompts(1, lo=30, hi=30, seed=99)[0]
        prompts = [shared + p for p in prompts]
    expected = hf_greedy(str(model_dir), tuple(map(tuple, prompts)), MAX_NEW)
    llm = _llm(model_dir, eager, **MODES[mode])
    assert engine_greedy(llm, prompts, MAX_NEW) == expected
    if mode == "prefix_cache":  # again, now through cached prefix blocks
        assert engine_greedy(llm, prompts, MAX_NEW, min_cached_tokens=24 * num_prompts) == expected
    assert (_replays(llm) == 0) == eager


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("arch", ["llama3", "smollm2", "mistral", "qwen2", "gpt2", "bloom"])
def test_every_architecture_greedy_equals_hf(tiny_model_dirs, arch, eager):
    prompts = random_prompts(11, lo=3, hi=60, seed=5)
    expected = hf_greedy(str(tiny_model_dirs[arch]), tuple(map(tuple, prompts)), MAX_NEW)
    llm = _llm(tiny_model_dirs[arch], eager)
    assert engine_greedy(llm, prompts, MAX_NEW) == expected
    assert (_replays(llm) == 0) == eager


def test_full_bucket_and_beyond(tiny_model_dirs):
    # more requests than max_num_seqs: the scheduler caps the batch at the largest bucket (8), 4 wait behind it
    # (each prompt more costs an HF reference on the host and nothing new here)
    model_dir = tiny_model_dirs["llama"]
    prompts = random_prompts(12, lo=3, hi=30, seed=11)
    expected = hf_greedy(str(model_dir), tuple(map(tuple, prompts)), MAX_NEW)
    llm = _llm(model_dir, eager=False, max_num_seqs=8)
    assert llm.engine.core.runner.graphs.sizes == [1, 2, 4, 8]
    assert engine_greedy(llm, prompts, MAX_NEW) == expected
    assert _replays(llm) > 0


def test_short_and_long_context_graphs(tiny_model_dirs):
    # a 40-token short class: steps at contexts 31..46 replay both graphs of their bucket
    model_dir = tiny_model_dirs["llama"]
    prompts = random_prompts(4, lo=30, hi=30, seed=12)
    expected = hf_greedy(str(model_dir), tuple(map(tuple, prompts)), MAX_NEW)
    llm = _llm(model_dir, eager=False, max_num_seqs=8)
    runner = llm.engine.core.runner
    runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, 8, runner.max_model_len, runner.block_size,
                                 short_context=40)
    assert runner.graphs.capture()
    assert engine_greedy(llm, prompts, MAX_NEW) == expected
    assert runner.graphs.replays_by_len[40] > 0 and runner.graphs.replays_by_len[128] > 0


def _syncs_in_one_step(core) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            core.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # only the syncs themselves: the first set_sync_debug_mode in a process also warns that the mode is a
    # prototype ("Synchronization debug mode is ..."), which counted as a sync when this ran first
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


# async scheduling (on by default on CUDA) reads a step's ids during the next step, so it is off here, where the
# point is that the step reads them at all with one sync; test_async_gpu.py covers the overlapped path
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_a_step_syncs_once_to_read_the_sampled_ids(tiny_model_dirs, eager):
    llm = _llm(tiny_model_dirs["llama"], eager, async_scheduling=False)
    core = llm.engine.core
    prompts = random_prompts(3, lo=5, hi=20, seed=2)
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)]
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(core.make_request(f"r{i}", p, sp))
    assert _syncs_in_one_step(core) == 1  # the prefill step (eager either way)
    before = _replays(llm)
    for _ in range(3):
        assert _syncs_in_one_step(core) == 1  # decode steps
    assert _replays(llm) == (before if eager else before + 3)


def test_sampled_decode_is_reproducible_with_seeds(tiny_model_dirs):
    # seeded sampling through graphs equals seeded sampling through eager steps: same logits (fp32),
    # same per-request generator streams
    prompts = random_prompts(5, lo=5, hi=30, seed=3)
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=12, ignore_eos=True)
              for i in range(5)]
    runs = []
    for eager in (False, True):
        llm = _llm(tiny_model_dirs["llama"], eager)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1]
