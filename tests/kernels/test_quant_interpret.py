"""The weight-only quantized matmul kernels (kernels/triton/w4a16.py) against dequantize-then-matmul
(kernels/quant.py), at small shapes through Triton's CPU interpreter; tests/gpu/test_quant_gpu.py runs
the same checks at real shapes on a GPU. Both shapes of each kernel are forced (GEMV and GEMM), with
ragged row and column counts, act-order ``g_idx``, and groups smaller than a K tile.
"""


import pytest
import torch

from tests.kernels.interpreted import interpret_triton_kernels

interpret_triton_kernels("tests/gpu/test_quant_gpu.py")
from kvrelay.kernels.triton import w4a16 as kernel  # noqa: E402
from tests.kernels.quant_cases import check_int8, check_w4  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 21])
@pytest.mark.parametrize("gemv", [True, False])
def test_w4(dtype, rows, gemv):
    check_w4(kernel, "cpu", rows, 256, 72, 64, dtype, act_order=False, gemv=gemv, bias=True)


@pytest.mark.parametrize("gemv", [True, False])
def test_w4_act_order_and_small_groups(gemv):
    # g_idx gathers scales per input row; group 32 < BLOCK_K 64 puts two groups in one K tile
    check_w4(kernel, "cpu", 5, 128, 40, 32, torch.float32, act_order=True, gemv=gemv, bias=False)
    check_w4(kernel, "cpu", 5, 128, 40, 32, torch.bfloat16, act_order=False, gemv=gemv, bias=False,
             cfg=(16, 32, 64))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemv", [True, False])
def test_int8(dtype, gemv, kind):
    check_int8(kernel, "cpu", 6, 96, 40, dtype, gemv=gemv, kind=kind)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_one_row_through_the_skinny_loop(kind):
    # batch-1 decode's path for 8-bit weights (kernels/triton/skinny_linear.py): K not a multiple of the
    # tile, N not a multiple of the rows per program
    from kvrelay.kernels.triton import skinny_linear

    def op(x, w, s):
        return skinny_linear.scaled_linear(x, w, s, cfg=(8, 64, 4))

    check_int8(kernel, "cpu", 1, 200, 44, torch.bfloat16, kind=kind, op=op)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("k", [600, 8200])
def test_one_row_through_the_skinny_loops_own_tiles(kind, k):
    # the tiles skinny_linear.config picks for 8-bit weights, on either side of its K threshold: K past a tile,
    # N not a multiple of the rows a program takes
    from kvrelay.kernels.triton import skinny_linear

    assert skinny_linear.config(7, k, 1)[1] < k
    check_int8(kernel, "cpu", 1, k, 7, torch.bfloat16, kind=kind,
               op=lambda x, w, s: skinny_linear.scaled_linear(x, w, s))
