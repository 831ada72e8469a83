"""The decode GEMV over the repacked W4 layout (kernels/triton/w4_gemv.py) and the table that picks it
(kernels/triton/w4_decode.py) against dequantize-then-matmul of the published weights, through Triton's CPU
interpreter: AWQ, GPTQ with and without act-order, groups of 32, 64 and 128, output counts no tile divides,
1 to 16 rows, split K summed in order and by atomics.
"""


import pytest
import torch

from tests.kernels.interpreted import interpret_triton_kernels

interpret_triton_kernels("tests/gpu/test_w4_gemv_gpu.py")
from kvrelay.kernels.triton import w4_decode  # noqa: E402
from tests.kernels.quant_cases import check_w4_packed, w4_gemv_variant  # noqa: E402

SOURCES = ["awq", "gptq", "gptq_act_order"]
VARIANTS = ["gemv", "atomic"]


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_sources_and_groups(name, source, group):
    check_w4_packed(w4_gemv_variant(name), "cpu", 1, 256, 40, group, torch.bfloat16, source, bias=True, cfg=(16, 2, 1, 1, 1))


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("rows", [1, 4])
def test_the_default_configuration(name, rows):
    # one split at these sizes on the CPU (one "SM"), so the bias in the kernel
    check_w4_packed(w4_gemv_variant(name), "cpu", rows, 256, 40, 128, torch.bfloat16, "awq", bias=True)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("rows", [2, 5, 16])
def test_rows_and_ragged_outputs(name, rows):
    # 37 outputs: no column tile divides them; rows padded to 2, 8 and 16
    check_w4_packed(w4_gemv_variant(name), "cpu", rows, 128, 37, 64, torch.bfloat16, "w4_act_order", bias=True,
                    cfg=(16, 4, 1, 1, 1))


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dtypes(name, dtype):
    check_w4_packed(w4_gemv_variant(name), "cpu", 3, 128, 40, 32, dtype, "gptq_act_order", bias=True, cfg=(32, 2, 1, 1, 1))


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("source, split", [("awq", 2), ("awq", 3), ("awq", 8), ("gptq_act_order", 3)])
def test_split_k(name, source, split):
    # 256 inputs in chunks of 4 packed rows: 8 chunks, so 3 splits leave the last one short; the bias once
    check_w4_packed(w4_gemv_variant(name), "cpu", 3, 256, 40, 32, torch.bfloat16, source, bias=True,
                    cfg=(16, 4, split, 1, 1))


def test_split_k_scratch_needs_no_zeroing(unzeroed_empty):
    # the in-order splits' slots come unzeroed from torch.empty, which the fixture fills with NaN
    check_w4_packed(w4_gemv_variant("gemv"), "cpu", 3, 256, 40, 32, torch.bfloat16, "awq", bias=True, cfg=(16, 4, 3, 1, 1))


def test_atomic_splits_write_every_output_and_hand_on_a_zeroed_scratch(unzeroed_empty):
    # the output comes NaN-filled from torch.empty: each tile's last split to arrive must write all of it; the
    # second weight (another group size, other values) adds into the scratch the first left, which must be zero
    from kvrelay.kernels.triton import split_arrival

    for group in (32, 64):
        check_w4_packed(w4_gemv_variant("atomic"), "cpu", 3, 256, 40, group, torch.bfloat16, "awq", bias=True,
                        cfg=(16, 4, 3, 1, 1))
    sums, counters = split_arrival.scratch(torch.device("cpu"), 3 * 40, 3)
    assert not sums.any() and not counters.any()


def test_a_chunk_that_does_not_divide_the_tile_is_refused():
    with pytest.raises(ValueError, match="does not divide a K tile"):
        check_w4_packed(w4_gemv_variant("gemv"), "cpu", 1, 128, 40, 32, torch.bfloat16, "awq", cfg=(16, 8, 1, 1, 1))


def test_more_rows_than_the_gemv_takes_are_refused():
    with pytest.raises(ValueError, match="at most 16 rows"):
        check_w4_packed(w4_gemv_variant("gemv"), "cpu", 17, 128, 40, 32, torch.bfloat16, "awq")


@pytest.mark.parametrize("kernel", sorted(w4_decode.DECODE_KERNELS))
@pytest.mark.parametrize("rows", [1, 4, 5])
def test_each_decode_kernel_the_table_names(kernel, rows, monkeypatch):
    # up to DECODE_MAX_ROWS rows take the named kernel, more take w4_fast; every entry gives the reference
    calls = []

    def spy(name, real):
        return lambda *args, **kwargs: calls.append(name) or real(*args, **kwargs)

    monkeypatch.setattr(w4_decode.w4_fast, "w4_packed_linear", spy("w4_fast", w4_decode.w4_fast.w4_packed_linear))
    monkeypatch.setattr(w4_decode, "DECODE_KERNELS", {
        name: None if entry is None else spy("decode", entry) for name, entry in w4_decode.DECODE_KERNELS.items()})
    monkeypatch.setattr(w4_decode, "DECODE_KERNEL", kernel)
    monkeypatch.setattr(w4_decode, "DECODE_MAX_ROWS", 4)
    dispatch = type("Dispatch", (), {"w4_packed_linear": staticmethod(
        lambda x, p, bias=None, cfg=None: w4_decode.w4_packed_linear(x, p, bias))})
    check_w4_packed(dispatch, "cpu", rows, 256, 40, 64, torch.bfloat16, "gptq", bias=True)
    assert calls == ["decode" if kernel != "w4_fast" and rows <= 4 else "w4_fast"]
