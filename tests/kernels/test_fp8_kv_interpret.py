"""The Triton KV kernels on an fp8 (e4m3) cache at small shapes through Triton's CPU interpreter:
writes (plain and fused with rotary) store exactly what kernels/reference.py stores, and decode,
split-K decode, prefill/mixed and fused rotary decode attention read the float8 cache with its per-layer
scales and match attention over the cache dequantized first (tests/kernels/fp8_kv_cases.py).

Run: ``TRITON_INTERPRET=1 python -m pytest tests/kernels/test_fp8_kv_interpret.py -q``."""


import pytest
import torch

from tests.kernels.interpreted import interpret_triton_kernels

interpret_triton_kernels("tests/gpu/test_fp8_kv_gpu.py")
import kvrelay.kernels.triton as tk  # noqa: E402
from kvrelay.kernels.triton.prefill_attention import FP32_CANDIDATES  # noqa: E402
from tests.kernels import fp8_kv_cases as cases  # noqa: E402

DEV = "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv(dtype):
    cases.check_write_kv(tk, DEV, 37, 2, 32, 8, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_write_kv(dtype):
    cases.check_rotary_write_kv(tk, DEV, 21, 4, 2, 32, 8, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_attention(dtype, group):
    cases.check_paged_attention(tk, DEV, [1] * 4, [1, 37, 130, 64], 8, 8 // group, 32, 16, dtype, seed=group)


def test_decode_split_k():
    cases.check_paged_attention(tk, DEV, [1] * 3, [200, 5, 129], 8, 2, 32, 16, torch.float32, num_splits=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention(dtype):
    # plain prefill, chunked prefill over a cached prefix, and decode rows in one mixed batch
    cases.check_paged_attention(tk, DEV, [5, 1, 40, 17], [5, 70, 100, 17], 8, 2, 32, 8, dtype, seed=5)


@pytest.mark.parametrize("config", FP32_CANDIDATES, ids=str)
def test_prefill_fp32_candidate_tilings(config):
    # the fp32 prefill tilings bench/triton_fp32_compile.py times, over an fp8 cache
    cases.check_paged_attention(tk, DEV, [5, 1, 40, 17], [5, 70, 100, 17], 8, 2, 32, 8, torch.float32, seed=5,
                                configs=[config])


@pytest.mark.parametrize("num_splits", [None, 3])
def test_rotary_decode_attention(num_splits):
    cases.check_rotary_decode_attention(tk, DEV, [1, 37, 200, 9], 8, 2, 32, 8, torch.float32, num_splits)


@pytest.mark.parametrize("head_dim", [16, 3])
def test_copy_blocks_moves_fp8_bytes(head_dim):
    # the handoff's device copy: whole words where rows allow, single bytes (uint8, never float8 loads)
    # where a row of 3-byte heads is not word-aligned; the reference the CPU handoff runs agrees
    from kvrelay.kernels import reference
    from kvrelay.kernels.triton.copy_blocks import copy_blocks

    gen = torch.Generator().manual_seed(head_dim)
    src = (torch.randn(3, 2, 12, 4, 2, head_dim, generator=gen) * 30).to(cases.FP8)
    dst, expected = (torch.zeros(3, 2, 9, 4, 2, head_dim, dtype=cases.FP8) for _ in range(2))
    si, di = torch.tensor([7, 0, 11, 3], dtype=torch.int32), torch.tensor([2, 8, 0, 5], dtype=torch.int32)
    copy_blocks(src, si, dst, di, range(1, 3))
    reference.copy_blocks(src, si, expected, di, range(1, 3))
    want = torch.zeros_like(expected.view(torch.uint8))
    want[1:3, :, di.long()] = src.view(torch.uint8)[1:3, :, si.long()]
    assert torch.equal(expected.view(torch.uint8), want) and torch.equal(dst.view(torch.uint8), want)
