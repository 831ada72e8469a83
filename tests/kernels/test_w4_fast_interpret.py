"""The repacked W4 layout (kernels/w4_repack.py) and its kernel (kernels/triton/w4_fast.py) against
dequantize-then-matmul of the published weights, through Triton's CPU interpreter: AWQ, GPTQ with and
without act-order, groups of 32, 64 and 128, output counts no tile divides, one row and several, split K.
"""

import pytest
import torch

from tests.kernels.interpreted import interpret_triton_kernels

interpret_triton_kernels("tests/gpu/test_quant_gpu.py")
from kvrelay.kernels import quant  # noqa: E402
from kvrelay.kernels.triton import w4_fast as kernel  # noqa: E402
from kvrelay.kernels.w4_repack import dequantize_packed, repack_w4  # noqa: E402
from kvrelay.shared.engine.quant import formats  # noqa: E402
from kvrelay.shared.engine.quant.config import QuantConfig  # noqa: E402
from kvrelay.shared.engine.quant.linear import W4Linear  # noqa: E402
from tests.kernels.quant_cases import check_w4_packed, w4_case  # noqa: E402
from tests.kernels.triton_cases import assert_close  # noqa: E402

SOURCES = ["awq", "gptq", "gptq_act_order"]


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_repacked_layout_reads_back_the_weight(group, act_order):
    q, zeros, scales, g_idx, _, _ = w4_case(1, 256, 24, group, torch.float32, act_order, False)
    packed = repack_w4(quant.pack_w4(q), zeros, scales, group, g_idx)
    assert (packed.perm is not None) == act_order
    expected = quant.dequantize_w4(quant.pack_w4(q), zeros, scales, group, g_idx)
    assert torch.equal(dequantize_packed(packed), expected)


def test_a_g_idx_that_is_not_whole_groups_is_refused():
    q, zeros, scales, _, _, _ = w4_case(1, 64, 8, 32, torch.float32, False, False)
    g_idx = torch.tensor([0] * 40 + [1] * 24, dtype=torch.int32)
    with pytest.raises(ValueError, match="not a permutation of whole groups"):
        repack_w4(quant.pack_w4(q), zeros, scales, 32, g_idx)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 5])
def test_sources_and_groups(source, group, rows):
    check_w4_packed(kernel, "cpu", rows, 256, 40, group, torch.bfloat16, source, bias=rows == 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 21, 40])
def test_dtypes_rows_and_ragged_outputs(dtype, rows):
    # 37 outputs: no column tile divides them; 21 and 40 rows take the 32- and 64-row tiles
    check_w4_packed(kernel, "cpu", rows, 128, 37, 64, dtype, "w4_act_order", bias=True)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("cfg", [(16, 16, 1), (16, 16, 2), (16, 32, 3), (32, 16, 8)])
def test_split_k(source, cfg):
    # one split stores the output itself; more store fp32 slots that a second launch sums; 3 splits of 8
    # tiles leave the last one short; the bias once
    check_w4_packed(kernel, "cpu", 3, 256, 40, 32, torch.bfloat16, source, bias=True, cfg=cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_split_k_dtypes_and_bias(dtype, split, bias):
    check_w4_packed(kernel, "cpu", 2, 256, 40, 64, dtype, "w4_act_order", bias=bias, cfg=(16, 32, split))


def test_split_k_scratch_needs_no_zeroing(unzeroed_empty):
    # the split slots come unzeroed from torch.empty, which the fixture fills with NaN: any slot the kernel left
    # unwritten would reach the output
    check_w4_packed(kernel, "cpu", 3, 256, 40, 32, torch.bfloat16, "awq", bias=True, cfg=(16, 16, 3))


def test_a_gptq_act_order_layer_sorted_once_loaded():
    # g_idx routed last, as a checkpoint may order it: the rows are sorted only once everything is in
    q, zeros, scales, g_idx, x, b = w4_case(5, 128, 40, 32, torch.bfloat16, True, True)
    layer = W4Linear(128, 40, True, torch.bfloat16, QuantConfig("gptq", True, 32, desc_act=True))
    published = formats.to_gptq(q, zeros.int(), scales, 32) | {"g_idx": g_idx, "bias": b}
    for suffix, t in published.items():
        param, _, convert = layer.route(suffix, None)
        param.data.copy_(convert(t) if convert else t)
    layer.finish_loading(mapped=False)
    packed = layer.packed()
    assert packed is not None and packed.perm is not None
    got = kernel.w4_packed_linear(x, packed, layer.bias)
    assert_close(got, quant.w4a16_linear(x.float(), quant.pack_w4(q), zeros, scales, 32, g_idx, b.float()), x.dtype)
