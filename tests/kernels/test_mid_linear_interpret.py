"""kernels/triton/mid_linear.py (the 16-256 row GEMM) against F.linear in fp32 through Triton's CPU interpreter:
every named config, each schedule with forced split counts (ragged last split, stream-K ranges that end inside a
tile), rows and outputs no tile divides, K no K tile divides, bias, fp16 and bf16.
tests/gpu/test_mid_linear_gpu.py runs every config at the Llama-3-8B shapes on a GPU.
"""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.interpreted import interpret_triton_kernels

interpret_triton_kernels("tests/gpu/test_mid_linear_gpu.py")
from kvrelay.kernels.triton import mid_linear as ml  # noqa: E402

HALF_ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # relative: one rounding of the fp32 sum


def case(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def check(m: int, n: int, k: int, dtype: torch.dtype, config, bias: bool = True) -> None:
    x, w, b = case(m, n, k, dtype, bias)
    got = ml.mid_linear(x, w, b, config=config)
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (m, n)
    # fp32 sums cast once: within one rounding of the exact result (the interpreter truncates fp32 to bf16
    # where the GPU rounds to nearest, hence a whole ulp), plus fp32 reordering
    torch.testing.assert_close(got.float(), expected, rtol=2 * HALF_ULP[dtype], atol=1e-3)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(ml.CONFIGS))
def test_every_named_config(name, dtype, bias):
    # 20 rows, 40 outputs: no row or column tile divides them; K 200: no K tile (64, 128) divides it
    check(20, 40, 200, dtype, name, bias)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("split", [1, 2, 3, 5])
@pytest.mark.parametrize("variant", ml.VARIANTS)
def test_forced_splits(variant, split, tma):
    # 7 K tiles of 64: 3 splits of 3 leave the last one a single tile; persistent: `split` programs walk
    # 2 x 2 tiles x 7 K tiles = 28 iterations, 3 and 5 of them ending ranges inside a tile
    cfg = ml.MidConfig(variant, 32, 32, 64, 4, 2, split, tma)
    check(40, 50, 448, torch.bfloat16, cfg)


@pytest.mark.parametrize("variant", ml.VARIANTS)
def test_one_row_and_a_row_batch_of_leading_dims(variant):
    cfg = ml.MidConfig(variant, 64, 32, 64, 4, 2, 2)
    check(1, 24, 128, torch.bfloat16, cfg)
    x, w, b = case(6, 24, 128, torch.float16, True)
    got = ml.mid_linear(x.view(2, 3, 128), w, b, config=cfg)
    assert got.shape == (2, 3, 24)
    assert torch.equal(got.view(6, 24), ml.mid_linear(x, w, b, config=cfg))


def test_split_scratch_needs_no_zeroing(unzeroed_empty):
    # the split slots (and the output) come unzeroed from torch.empty, which the fixture fills with NaN: any element
    # the kernels left unwritten would reach the output
    for variant in ml.VARIANTS:
        check(40, 50, 448, torch.bfloat16, ml.MidConfig(variant, 32, 32, 64, 4, 2, 3))


def test_zero_rows():
    x, w, _ = case(0, 24, 64, torch.bfloat16, False)
    assert ml.mid_linear(x, w).shape == (0, 24)


def test_default_config_is_a_named_one():
    assert ml.default_config(128, 4096, 4096, torch.device("cpu")) in ml.CONFIGS.values()


@pytest.mark.parametrize("what, match", [
    ("fp32", "fp16 or bf16"), ("mixed", "fp16 or bf16"), ("k", "features"), ("strided", "contiguous"),
    ("variant", "unknown mid_linear variant"), ("tma_k", "K a multiple of 8"),
])
def test_refusals(what, match):
    x, w, _ = case(4, 24, 64, torch.bfloat16, False)
    cfg = None
    if what == "fp32":
        x, w = x.float(), w.float()
    elif what == "mixed":
        w = w.half()
    elif what == "k":
        x = x[:, :32]
    elif what == "strided":
        w = torch.randn(64, 24).to(torch.bfloat16).t()
    elif what == "tma_k":  # a tensor descriptor's row stride must be a multiple of 16 bytes
        x, w, cfg = x[:, :60], w[:, :60].contiguous(), "split_n128_k64_tma"
    else:
        cfg = replace(ml.CONFIGS["split_n64_k128"], variant="splitk")
    with pytest.raises(ValueError, match=match):
        ml.mid_linear(x, w, config=cfg)
