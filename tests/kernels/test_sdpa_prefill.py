"""kernels/sdpa_prefill.py: which steps go to torch's SDPA, the padded lengths and calls they run in, and that
the padded, grouped attention matches the reference.

Runs on the CPU (SDPA's CPU kernels); tests/kernels/test_triton_gpu.py covers the registered op on CUDA."""

import pytest
import torch

from kvrelay.kernels import reference
from kvrelay.kernels.sdpa_prefill import (
    MAX_PER_CALL,
    MIN_LEN,
    bucket,
    buckets,
    calls,
    plan_shapes,
    prompt_spans,
    sdpa_prefill,
    warm_up,
)
from tests.kernels import triton_cases as cases


def _meta(q_lens: list[int], seq_lens: list[int]):
    return cases.make_paged_case(q_lens, seq_lens, 4, 2, 16, 16, torch.float32, "cpu")[2]


def test_whole_long_prompts_take_sdpa():
    assert prompt_spans(_meta([1024, 1024, 2000], [1024, 1024, 2000])) == [(0, 1024), (1024, 1024), (2048, 2000)]
    lens = [1100] * 9
    assert len(prompt_spans(_meta(lens, lens))) == 9  # more prompts than a call takes: several calls


def test_a_cached_prefix_a_later_chunk_or_a_short_prompt_keeps_the_paged_kernel():
    assert prompt_spans(_meta([2000, 1500], [2000, 1600])) is None  # 100 tokens of prefix in the cache
    assert prompt_spans(_meta([1, 3000], [40, 3000])) is None  # a decode row beside a prompt
    assert prompt_spans(_meta([1500, 100], [1500, 100])) is None  # a short prompt: one launch for all


def test_lengths_pad_to_eight_per_octave():
    assert [bucket(n) for n in (1024, 1025, 1152, 1153, 2047, 2049, 4001, 4096, 4097)] == [
        1024, 1152, 1152, 1280, 2048, 2304, 4096, 4096, 4608]
    for n in range(MIN_LEN, 20000, 37):
        assert n <= bucket(n) <= n * 1.125
    sizes = buckets(8192)
    assert sizes[0] == 1024 and sizes[-1] == 8192 and len(sizes) == 25
    assert all(bucket(n) in sizes for n in range(MIN_LEN, 8193))  # warm_up covers every prompt length


def test_prompts_of_one_padded_length_share_a_call_of_at_most_max_per_call():
    spans = [(i * 1100, 1100) for i in range(MAX_PER_CALL + 2)] + [(99999, 4000)]
    assert calls(spans) == [(1152, spans[:MAX_PER_CALL]), (1152, spans[MAX_PER_CALL:-1]), (4096, spans[-1:])]


def test_every_call_a_step_can_make_has_a_warmed_plan():
    budget = 8192
    shapes = set(plan_shapes(budget, budget))
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):  # random steps of whole prompts within the budget
        lens, total = [], 0
        while True:
            n = int(torch.randint(MIN_LEN, budget + 1, (1,), generator=gen))
            if total + n > budget:
                break
            lens.append(n)
            total += n
        rows = [sum(lens[:i]) for i in range(len(lens))]
        for padded, group in calls(list(zip(rows, lens, strict=True))):
            assert (len(group), padded) in shapes
    assert len(shapes) == 77  # about 45 ms each to build on an H200


@pytest.mark.parametrize("lens", [[1030, 1030, 1100, 2000], [1100], [1024], [1024, 1024], [1024, 1152, 1024]],
                         ids=["grouped-padded", "one-padded", "one-exact", "two-exact-views", "exact-not-adjacent"])
def test_padded_grouped_attention_matches_the_reference(lens):
    # 1030 and 1100 pad to 1152 and share a call: the padding must never reach a real query; exact adjacent
    # prompts run on views of the step's rows
    q, kv_cache, meta = cases.make_paged_case(lens, lens, 8, 2, 32, 16, torch.float32, "cpu", seed=3)
    k, v = cases.fresh_kv(kv_cache, meta)  # strided views, as they come out of the fused qkv projection
    out = sdpa_prefill(q, k, v, prompt_spans(meta), 32 ** -0.5)
    expected = reference.paged_attention(q, kv_cache, meta, 32 ** -0.5)
    assert out.shape == q.shape
    cases.assert_close(out, expected, torch.float32)


def test_warm_up_runs_each_call_shape_for_half_precision_only():
    assert warm_up(torch.empty(1, 4, 16, dtype=torch.bfloat16), 2, 1500, 3000) == len(plan_shapes(1500, 3000)) == 10
    assert warm_up(torch.empty(1, 4, 16), 2, 1500, 3000) == 0  # fp32 keeps the Triton kernel
    assert warm_up(torch.empty(1, 4, 16, dtype=torch.bfloat16), 2, 512, 512) == 0  # no prompt long enough
