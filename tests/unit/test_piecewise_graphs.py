"""The piecewise path (shared/engine/piecewise_graphs.py) without a GPU: its buckets, and its pieces run
eagerly on the static padded buffers (``record=False``), against the plain eager engine in fp32: mixed
steps of chunked prompts beside decodes, prefix-cache hits, several buckets, steps of exactly a bucket's
tokens and steps past the largest bucket (eager). tests/gpu/test_piecewise_graphs_gpu.py covers capture
and replay on CUDA."""

import logging
import math
from collections import Counter

import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.shared.engine.piecewise_graphs import (
    PiecewiseGraphs,
    capture_piecewise,
    static_bytes,
    token_buckets,
    unsupported,
)
from tests.conftest import random_prompts

SIZES = [4, 8, 16, 24]  # under a 32-token step budget: steps of 25..32 tokens run eagerly; 4: a full decode batch
MODES = {
    "chunked": dict(enable_chunked_prefill=True, max_num_batched_tokens=32, enable_prefix_caching=False),
    # decode rows take the previous step's ids on the device (fill) before their copy into the static ids
    "async": dict(enable_chunked_prefill=True, max_num_batched_tokens=32, enable_prefix_caching=False,
                  async_scheduling=True),
    "prefix_cache": dict(enable_chunked_prefill=True, max_num_batched_tokens=32, enable_prefix_caching=True,
                         block_size=8),
}


def test_token_buckets():
    assert token_buckets(2048) == [8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, *range(640, 2049, 128)]
    assert token_buckets(40) == [8, 12, 16, 24, 32, 40]
    assert token_buckets(700) == [8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 640, 700]
    assert token_buckets(5) == [5]
    sizes = token_buckets(4096)
    assert all(b - a <= max(a // 2, 128) for a, b in zip(sizes, sizes[1:], strict=False))  # bounded padding
    with pytest.raises(ValueError):
        token_buckets(0)


def _llm(model_dir, piecewise: bool, **kwargs) -> LLM:
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128, device="cpu", max_num_seqs=4, **kwargs)
    if piecewise:
        runner = llm.engine.core.runner
        assert unsupported(runner.model) == ""
        runner.piecewise = PiecewiseGraphs(runner.model, runner.kv_cache, 24, record=False, sizes=SIZES)
        assert runner.piecewise.capture()
    return llm


def _watch(llm: LLM) -> tuple[Counter, list[int]]:
    """(token counts of the steps the pieces ran, of those the eager forward ran): the real methods, counted."""
    runner = llm.engine.core.runner
    pieces, eager = Counter(), []
    run, forward = runner.piecewise.run, runner._forward

    def counted_run(input_ids, positions, meta):
        pieces[input_ids.shape[0]] += 1
        return run(input_ids, positions, meta)

    def counted_forward(out, t, meta):
        eager.append(t.input_ids.shape[0])
        return forward(out, t, meta)

    runner.piecewise.run, runner._forward = counted_run, counted_forward
    return pieces, eager


def _generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list, list]]:
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    core = llm.engine.core
    assert core.num_free_blocks == core.num_total_blocks, "KV blocks leaked"
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]


def _close(a, b) -> bool:
    """Position logprobs (dicts token -> Logprob, or None) equal in tokens and within fp32 noise in values."""
    if a is None or b is None:
        return a is b
    return a.keys() == b.keys() and all(math.isclose(a[t].logprob, b[t].logprob, abs_tol=1e-4) for t in a)


def _assert_same(got, want) -> None:
    for (tokens, lps, plps), (w_tokens, w_lps, w_plps) in zip(got, want, strict=True):
        assert tokens == w_tokens
        assert all(_close(a, b) for a, b in zip(lps, w_lps, strict=True))
        assert len(plps) == len(w_plps) and all(_close(a, b) for a, b in zip(plps, w_plps, strict=True))


@pytest.mark.parametrize("mode", list(MODES))
def test_pieces_on_padded_buffers_equal_the_eager_engine(tiny_model_dirs, mode):
    # 9 prompts under max_num_seqs=4: later prompts arrive (in chunks of the 32-token budget) while earlier
    # ones decode, so steps mix prompt chunks with decodes at many token counts
    model_dir = tiny_model_dirs["llama"]
    prompts = random_prompts(9, lo=5, hi=70, seed=7)
    if mode == "prefix_cache":
        shared = random_prompts(1, lo=24, hi=24, seed=99)[0]  # 3 full blocks of 8, then each prompt's own
        prompts = [shared + p[:40] for p in prompts]
    want = _generate(_llm(model_dir, False, **MODES[mode]), prompts)
    llm = _llm(model_dir, True, **MODES[mode])
    pieces, eager = _watch(llm)
    _assert_same(_generate(llm, prompts), want)
    if mode == "prefix_cache":  # again, now that the shared prefix is cached
        again = _generate(llm, prompts)
        assert sum(o.num_cached_tokens for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                             SamplingParams(max_tokens=1))) >= 24 * len(prompts)
        _assert_same(again, want)
    buckets = llm.engine.core.runner.piecewise.replays_by_bucket
    assert len(buckets) >= 3, buckets  # several buckets served steps
    assert any(n > 4 for n in pieces), pieces  # steps holding prompt tokens (4 sequences at most decode)
    assert any(n in SIZES for n in pieces), pieces  # a step of exactly a bucket's tokens (no padding)
    assert any(n not in SIZES for n in pieces), pieces  # and padded ones
    assert eager and all(n > SIZES[-1] for n in eager), eager  # past the largest bucket: the eager forward


def test_other_architectures_keep_decode_graphs_and_say_so(tiny_model_dirs, caplog):
    for arch in ("gpt2", "bloom"):
        llm = LLM(model=str(tiny_model_dirs[arch]), dtype="float32", max_model_len=64)
        runner = llm.engine.core.runner
        assert "not of the Llama family" in unsupported(runner.model)
        with caplog.at_level(logging.INFO, logger="kvrelay.shared.engine.piecewise_graphs"):
            assert capture_piecewise(runner.model, runner.kv_cache, llm.engine.config, 64) is None
        assert f"steps with prompt tokens of {llm.engine.config.model.model} run eagerly" in caplog.text
    runner = LLM(model=str(tiny_model_dirs["qwen2"]), dtype="float32", max_model_len=64).engine.core.runner
    assert unsupported(runner.model) == ""


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_kv_profile_counts_the_static_buffers_the_pieces_hold(tiny_model_dirs, arch):
    runner = LLM(model=str(tiny_model_dirs[arch]), dtype="float32", max_model_len=64).engine.core.runner
    pieces = PiecewiseGraphs(runner.model, runner.kv_cache, 40, record=False)
    assert static_bytes(runner.model, 40) == pieces.static_bytes > 0
