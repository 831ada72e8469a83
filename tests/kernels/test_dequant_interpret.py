"""Whole-weight dequantization (kernels/triton/dequant.py) and the row-count dispatch of the weight-only
matmuls (kernels/triton/dequant_linear.py), through Triton's CPU interpreter at small shapes;
tests/gpu/test_dequant_gpu.py runs them at Llama-3-8B shapes on a GPU.
"""

import pytest
import torch

from tests.kernels.interpreted import interpret_triton_kernels

interpret_triton_kernels("tests/gpu/test_dequant_gpu.py")
from tests.kernels.dequant_cases import (  # noqa: E402
    DEQUANT_FN,
    LAYOUTS,
    check_dequantized,
    check_few_rows,
    check_many_rows,
    count_calls,
    kernel_modules,
    layer,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group, act_order", [(32, False), (64, True), (128, False), (16, True)])
@pytest.mark.parametrize("layout", ["packed", "plain"])
def test_w4_dequantized_equals_the_reference(layout, group, act_order, dtype):
    # N 40: no multiple of the 128-column tile; groups of 16 repack with K tiles of 16 (two words a tile)
    check_dequantized(layer(layout, "cpu", 256, 40, group, act_order), dtype)


def test_plain_w4_with_k_not_a_multiple_of_the_tile():
    # K 200: the last 64-input tile is ragged (whole words, partial tile)
    check_dequantized(layer("plain", "cpu", 200, 24, 8, True), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_dequantized_equals_the_reference(dtype):
    check_dequantized(layer("int8", "cpu", 300, 45, 0), dtype)


def test_fp8_weight_dequantizes_in_the_same_kernel():
    from kvrelay.kernels import quant

    dequant, _ = kernel_modules()
    w, s = quant.quantize_channel(torch.randn(37, 290, generator=torch.Generator().manual_seed(3)), "fp8")
    assert torch.equal(dequant.dequantize_channel(w, s, torch.bfloat16), quant.dequantize_channel(w, s, torch.bfloat16))


def test_bf16_rounds_to_nearest_even():
    # products exactly halfway between two bf16 values (u: a bf16 unit at 1.0): 1 + u/2 goes down to 1,
    # 1 + 3u/2 up to 1 + 2u, the even neighbours, as torch's cast rounds (a truncating cast gives 1 + u for
    # the second, rounding half up 1 + u for the first)
    dequant, _ = kernel_modules()
    u = 2.0 ** -7
    w = torch.tensor([[1], [1], [-1], [-1]], dtype=torch.int8)
    scale = torch.tensor([1 + u / 2, 1 + 3 * u / 2] * 2, dtype=torch.float32)
    got = dequant.dequantize_channel(w, scale, torch.bfloat16)
    assert got.flatten().float().tolist() == [1.0, 1 + 2 * u, -1.0, -1 - 2 * u]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_many_rows_take_the_dequantized_weight(layout, monkeypatch):
    # at the threshold exactly: one dequantization, and the reference linear's result
    dequant, dequant_linear = kernel_modules()
    rows = dequant_linear.DEQUANT_MIN_ROWS
    assert rows == 256  # the default, vLLM's for AWQ
    calls = count_calls(monkeypatch, dequant, DEQUANT_FN[layout])
    check_many_rows(layer(layout, "cpu", 128, 40, 32, act_order=layout == "plain"), rows, 128, torch.bfloat16, "cpu")
    assert calls == [DEQUANT_FN[layout]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fewer_rows_take_the_fused_kernel(layout, monkeypatch):
    # one row below the threshold: nothing dequantized, the fused kernel's bits
    dequant, dequant_linear = kernel_modules()
    calls = count_calls(monkeypatch, dequant, DEQUANT_FN[layout])
    check_few_rows(layer(layout, "cpu", 64, 24, 32), dequant_linear.DEQUANT_MIN_ROWS - 1, 64, torch.bfloat16, "cpu")
    assert calls == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_threshold_is_read_at_call_time(layout, monkeypatch):
    # a lowered threshold (a benchmark's KVRELAY_DEQUANT_MIN_ROWS) sends a decode-sized batch down the
    # dequantized path; 3-D activations [batch, tokens, K] count their rows across both
    dequant, dequant_linear = kernel_modules()
    monkeypatch.setattr(dequant_linear, "DEQUANT_MIN_ROWS", 6)
    calls = count_calls(monkeypatch, dequant, DEQUANT_FN[layout])
    lay = layer(layout, "cpu", 64, 24, 32)
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    y = lay.op(x, None)
    assert y.shape == (2, 3, 24) and len(calls) == 1
    check_few_rows(lay, 5, 64, torch.float32, "cpu")
    assert len(calls) == 1


def test_scratch_is_reused_and_grows():
    _, dequant_linear = kernel_modules()
    device = torch.device("cpu")
    dequant_linear._scratch.pop(device, None)
    a = dequant_linear.scratch((64, 32), torch.bfloat16, device)
    b = dequant_linear.scratch((16, 8), torch.float32, device)  # smaller: the same memory
    assert a.data_ptr() == b.data_ptr() and b.shape == (16, 8) and b.dtype == torch.float32
    c = dequant_linear.scratch((128, 64), torch.bfloat16, device)  # larger: grown once, then kept
    assert dequant_linear._scratch[device].numel() == 128 * 64 * 2
    assert dequant_linear.scratch((64, 32), torch.bfloat16, device).data_ptr() == c.data_ptr()


def test_malformed_threshold_names_the_variable(monkeypatch):
    _, dequant_linear = kernel_modules()
    monkeypatch.setenv("KVRELAY_DEQUANT_MIN_ROWS", "many")
    with pytest.raises(ValueError, match="KVRELAY_DEQUANT_MIN_ROWS"):
        dequant_linear._min_rows()
    monkeypatch.setenv("KVRELAY_DEQUANT_MIN_ROWS", "512")
    assert dequant_linear._min_rows() == 512
