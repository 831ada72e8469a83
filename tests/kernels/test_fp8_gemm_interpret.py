"""kernels/triton/fp8_gemm.py (the prefill e4m3 GEMM, both scales in its epilogue) through Triton's CPU interpreter,
against the e4m3 operands multiplied in fp32 and scaled after: every named tile config's schedule at small tiles
(rows, columns and K that no tile divides; more tiles than programs, so the persistent loop wraps), fp16 and bf16 out.
tests/gpu/test_fp8_gemm_gpu.py runs the real configs at the Llama-3-8B shapes on a GPU.
"""

from dataclasses import replace

import pytest
import torch

from tests.kernels.interpreted import interpret_triton_kernels

interpret_triton_kernels("tests/gpu/test_fp8_gemm_gpu.py")
from kvrelay.kernels.triton import fp8_gemm as fg  # noqa: E402

E4M3_MAX = 448.0
HALF_ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def quantized(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a random matrix in e4m3 with one fp32 scale each, as fp8_quant.py makes them."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * (1 + torch.arange(rows))[:, None]
    scale = x.abs().amax(1) / E4M3_MAX
    return (x / scale[:, None]).to(torch.float8_e4m3fn), scale


def expected(xq, sx, wq, sw) -> torch.Tensor:
    return (xq.float() @ wq.float().t()) * sx.view(-1, 1) * sw.view(1, -1)


def check(m: int, n: int, k: int, cfg: fg.GemmConfig, dtype=torch.bfloat16) -> None:
    xq, sx = quantized(m, k, 0)
    wq, sw = quantized(n, k, 1)
    got = fg.fp8_gemm(xq, sx.view(m, 1), wq, sw, dtype, config=cfg)
    assert got.dtype == dtype and got.shape == (m, n)
    # one rounding of the fp32 result (the interpreter truncates where the GPU rounds to nearest: a whole ulp)
    torch.testing.assert_close(got.float(), expected(xq, sx, wq, sw), rtol=2 * HALF_ULP[dtype], atol=1e-3)


def small(cfg: fg.GemmConfig) -> fg.GemmConfig:
    """The config's shape ratios and grouping at tiles the interpreter runs in seconds."""
    return replace(cfg, block_m=cfg.block_m // 8, block_n=cfg.block_n // 8, block_k=max(16, cfg.block_k // 4))


@pytest.mark.parametrize("name", sorted(fg.CONFIGS))
def test_every_named_config_at_small_tiles(name):
    check(70, 88, 96, small(fg.CONFIGS[name]))  # no tile divides the rows or columns; ragged K for k64 configs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_out_dtypes_and_group_wider_than_the_rows(dtype):
    check(40, 64, 48, fg.GemmConfig(16, 16, 16, 8, 4, 2), dtype)


def test_groups_of_row_blocks_with_a_short_last_group():
    """7 row blocks in groups of 3 (the last one short) by 5 column blocks: a tile skipped or run twice shows."""
    check(7 * 16 - 5, 5 * 16, 32, fg.GemmConfig(16, 16, 16, 3, 4, 2))


def test_zero_rows_and_refusals():
    wq, sw = quantized(32, 32, 1)
    empty = torch.empty(0, 32).to(torch.float8_e4m3fn)
    assert fg.fp8_gemm(empty, torch.empty(0, 1), wq, sw).shape == (0, 32)
    with pytest.raises(ValueError, match="features"):
        fg.fp8_gemm(torch.zeros(4, 16).to(torch.float8_e4m3fn), torch.ones(4, 1), wq, sw)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        fg.fp8_gemm(torch.zeros(4, 32).to(torch.float8_e4m3fn), torch.ones(4, 1), wq, sw, torch.float32)


def test_fits_only_prefill_rows():
    wq, _ = quantized(64, 64, 1)
    assert not fg.fits(torch.zeros(fg.MIN_ROWS - 1, 64).to(torch.float8_e4m3fn), wq)
    assert fg.fits(torch.zeros(fg.MIN_ROWS, 64).to(torch.float8_e4m3fn), wq)
