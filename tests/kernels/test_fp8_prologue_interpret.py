"""The norm and SiLU*mul that write FP8 rows (kernels/triton/fp8_prologue.py) against the two kernels they fuse,
run one after the other, through Triton's CPU interpreter: the same scales and the same e4m3 bytes (the
interpreter's own fp8 conversion is not the GPU's, but both paths go through it, so the bytes must match);
tests/gpu/test_quant_gpu.py checks the fused matmuls on the GPU."""

import pytest
import torch

from tests.kernels.interpreted import interpret_triton_kernels

interpret_triton_kernels("tests/gpu/test_quant_gpu.py")
from kvrelay.kernels.triton import fp8_prologue  # noqa: E402
from kvrelay.kernels.triton.fp8_quant import quantize_per_token_fp8  # noqa: E402
from kvrelay.kernels.triton.rms_norm import rms_norm  # noqa: E402
from kvrelay.kernels.triton.silu_mul import silu_mul  # noqa: E402


def rows(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # rows of magnitudes 1e-2 .. 1e2, so each row's scale differs
    return (torch.randn(n, k, generator=gen) * torch.logspace(-2, 2, n)[:, None]).to(dtype)


def assert_same(fused: tuple[torch.Tensor, torch.Tensor], unfused: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, s), (q_ref, s_ref) = fused, unfused
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_writes_the_rows_the_quantization_would(dtype, with_residual):
    k = 96  # not a power of two: the row's tail is masked
    x, residual = rows(5, k, dtype, 1), rows(5, k, dtype, 2) if with_residual else None
    weight = (1 + torch.randn(k, generator=torch.Generator().manual_seed(3)) / 4).to(dtype)
    q, s, res = fp8_prologue.rms_norm_fp8(x, weight, 1e-5, residual)
    if residual is None:
        normed, res_ref = rms_norm(x, weight, 1e-5), x
    else:
        normed, res_ref = rms_norm(x, weight, 1e-5, residual)
    assert_same((q, s), quantize_per_token_fp8(normed))
    assert torch.equal(res, res_ref)
    assert s.shape == (5, 1) and q.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_writes_the_rows_the_quantization_would(dtype):
    x = rows(4, 2 * 80, dtype, 4)
    assert_same(fp8_prologue.silu_mul_fp8(x), quantize_per_token_fp8(silu_mul(x)))


def test_no_rows_and_what_fits():
    q, s = fp8_prologue.silu_mul_fp8(torch.zeros(0, 64, dtype=torch.bfloat16))
    assert q.shape == (0, 32) and s.shape == (0, 1)
    assert fp8_prologue.fits(torch.zeros(1, dtype=torch.bfloat16), fp8_prologue.MAX_COLS)
    assert not fp8_prologue.fits(torch.zeros(1, dtype=torch.bfloat16), fp8_prologue.MAX_COLS + 1)
    assert not fp8_prologue.fits(torch.zeros(1, dtype=torch.float32), 64)  # fp32 models keep the unfused ops
