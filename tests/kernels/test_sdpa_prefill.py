"""kernels/sdpa_prefill.py: which steps go to torch's SDPA, the padded lengths they run at, and that the
padded, per-prompt attention matches the reference.

Runs on the CPU (SDPA's CPU kernels); tests/kernels/test_triton_gpu.py covers the registered op on CUDA."""

import pytest
import torch

from kvrelay.kernels import reference
from kvrelay.kernels.sdpa_prefill import MIN_LEN, bucket, buckets, prompt_spans, sdpa_prefill, warm_up
from tests.kernels import triton_cases as cases


def _meta(q_lens: list[int], seq_lens: list[int]):
    return cases.make_paged_case(q_lens, seq_lens, 4, 2, 16, 16, torch.float32, "cpu")[2]


def test_whole_long_prompts_run_one_call_each():
    assert prompt_spans(_meta([1024, 1024, 2000], [1024, 1024, 2000])) == [(0, 1024), (1024, 1024), (2048, 2000)]


def test_a_cached_prefix_a_later_chunk_or_a_short_prompt_keeps_the_paged_kernel():
    assert prompt_spans(_meta([2000, 1500], [2000, 1600])) is None  # 100 tokens of prefix in the cache
    assert prompt_spans(_meta([1, 3000], [40, 3000])) is None  # a decode row beside a prompt
    assert prompt_spans(_meta([1500, 100], [1500, 100])) is None  # a short prompt: one launch for all
    lens = [1100] * 9
    assert prompt_spans(_meta(lens, lens)) is None  # nine launches


def test_lengths_pad_to_eight_per_octave():
    assert [bucket(n) for n in (1024, 1025, 1152, 1153, 2047, 2049, 4001, 4096, 4097)] == [
        1024, 1152, 1152, 1280, 2048, 2304, 4096, 4096, 4608]
    for n in range(MIN_LEN, 20000, 37):
        assert n <= bucket(n) <= n * 1.125
    sizes = buckets(8192)
    assert sizes[0] == 1024 and sizes[-1] == 8192 and len(sizes) == 25
    assert all(bucket(n) in sizes for n in range(MIN_LEN, 8193))  # warm_up covers every prompt length


@pytest.mark.parametrize("lens", [[1030, 1030, 1100], [1100], [1024]], ids=["three", "one-padded", "one-exact"])
def test_padded_attention_matches_the_reference(lens):
    # 1030 and 1100 pad to 1152: the padding must never reach a real query; 1024 runs on views
    q, kv_cache, meta = cases.make_paged_case(lens, lens, 8, 2, 32, 16, torch.float32, "cpu", seed=3)
    k, v = cases.fresh_kv(kv_cache, meta)  # strided views, as they come out of the fused qkv projection
    out = sdpa_prefill(q, k, v, prompt_spans(meta), 32 ** -0.5)
    expected = reference.paged_attention(q, kv_cache, meta, 32 ** -0.5)
    assert out.shape == q.shape
    cases.assert_close(out, expected, torch.float32)


def test_warm_up_runs_each_padded_length_for_half_precision_only():
    assert warm_up(torch.empty(1, 4, 16, dtype=torch.bfloat16), 2, 1500) == len(buckets(1500)) == 5
    assert warm_up(torch.empty(1, 4, 16), 2, 1500) == 0  # fp32 keeps the Triton kernel
