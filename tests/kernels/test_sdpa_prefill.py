"""kernels/sdpa_prefill.py: which steps go to torch's SDPA, and that it matches the reference there.

Runs on the CPU (SDPA's CPU kernels); tests/kernels/test_triton_gpu.py covers the registered op on CUDA."""

import torch

from kvrelay.kernels import reference
from kvrelay.kernels.sdpa_prefill import prompt_runs, sdpa_prefill
from tests.kernels import triton_cases as cases


def _meta(q_lens: list[int], seq_lens: list[int]):
    return cases.make_paged_case(q_lens, seq_lens, 4, 2, 16, 16, torch.float32, "cpu")[2]


def test_whole_prompts_group_into_runs_of_equal_length():
    assert prompt_runs(_meta([1024, 1024, 600, 2000], [1024, 1024, 600, 2000])) == [
        (0, 2, 1024), (2048, 1, 600), (2648, 1, 2000)]


def test_a_cached_prefix_or_a_later_chunk_keeps_the_paged_kernel():
    assert prompt_runs(_meta([2000, 1500], [2000, 1600])) is None  # 100 tokens of prefix in the cache
    assert prompt_runs(_meta([1, 3000], [40, 3000])) is None  # a decode row beside a prompt


def test_short_or_scattered_prompts_keep_one_triton_launch():
    assert prompt_runs(_meta([100, 100], [100, 100])) is None  # too few tokens per call
    lens = [1100 + i for i in range(9)]
    assert prompt_runs(_meta(lens, lens)) is None  # nine runs: nine launches


def test_sdpa_prefill_matches_the_reference():
    lens = [1030, 1030, 1100]
    q, kv_cache, meta = cases.make_paged_case(lens, lens, 8, 2, 32, 16, torch.float32, "cpu", seed=3)
    k, v = cases.fresh_kv(kv_cache, meta)  # strided views, as they come out of the fused qkv projection
    runs = prompt_runs(meta)
    assert runs == [(0, 2, 1030), (2060, 1, 1100)]
    out = sdpa_prefill(q, k, v, runs, 32 ** -0.5)
    expected = reference.paged_attention(q, kv_cache, meta, 32 ** -0.5)
    assert out.shape == q.shape
    cases.assert_close(out, expected, torch.float32)
