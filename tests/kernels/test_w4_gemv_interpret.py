"""The decode GEMV over the repacked W4 layout (kernels/triton/w4_gemv.py) and the table that picks it
(kernels/triton/w4_decode.py) against dequantize-then-matmul of the published weights, through Triton's CPU
interpreter: AWQ, GPTQ with and without act-order, groups of 32, 64 and 128, output counts no tile divides,
1 to 16 rows, split K summed in order, by atomics, and by atomics into a per-weight workspace whose last
split stores the output (left zeroed for the next call).
"""

import functools

import pytest
import torch

from tests.kernels.interpreted import interpret_triton_kernels

interpret_triton_kernels("tests/gpu/test_w4_gemv_gpu.py")
from kvrelay.kernels import quant  # noqa: E402
from kvrelay.kernels.triton import w4_decode, w4_gemv  # noqa: E402
from tests.kernels.quant_cases import check_w4_packed, w4_gemv_variant  # noqa: E402

SOURCES = ["awq", "gptq", "gptq_act_order"]
VARIANTS = ["gemv", "atomic", "last"]


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


def test_the_last_split_leaves_the_workspace_zeroed_for_the_next_call():
    from kvrelay.kernels.w4_repack import repack_w4
    from tests.kernels.quant_cases import w4_case

    q, zeros, scales, _, x, b = w4_case(3, 256, 40, 32, torch.bfloat16, False, True)
    packed = repack_w4(quant.pack_w4(q), zeros, scales, 32)
    reference = w4_gemv.w4_gemv_linear(x, packed, b, reduce="order", cfg=(16, 4, 3, 1, 1))
    for _ in range(3):  # a counter or a sum left behind would corrupt the next call
        got = w4_gemv.w4_gemv_linear(x, packed, b, reduce="last", cfg=(16, 4, 3, 1, 1))
        torch.testing.assert_close(got, reference, rtol=1e-2, atol=1e-2)
        space = w4_gemv._workspaces[packed.qweight]  # made by the call: "last" ran
        assert not space.sums.any() and not space.locks.any()
        assert space.sums.shape == (w4_gemv.LAST_ROWS, 40)


def test_the_last_split_runs_as_atomic_beyond_its_workspace_rows():
    from kvrelay.kernels.w4_repack import repack_w4
    from tests.kernels.quant_cases import w4_case

    q, zeros, scales, _, x, _ = w4_case(w4_gemv.LAST_ROWS + 1, 256, 40, 32, torch.bfloat16, False, False)
    packed = repack_w4(quant.pack_w4(q), zeros, scales, 32)
    got = w4_gemv.w4_gemv_linear(x, packed, reduce="last", cfg=(16, 4, 3, 1, 1))
    torch.testing.assert_close(got, w4_gemv.w4_gemv_linear(x, packed, reduce="order", cfg=(16, 4, 3, 1, 1)),
                               rtol=1e-2, atol=1e-2)
    assert packed.qweight not in w4_gemv._workspaces  # never asked for: "atomic" ran


def test_an_unknown_reduce_is_refused():
    with pytest.raises(ValueError, match="reduce must be one of order, atomic, last"):
        check_w4_packed(type("V", (), {"w4_packed_linear": staticmethod(
            functools.partial(w4_gemv.w4_gemv_linear, reduce="sum"))}), "cpu", 1, 128, 40, 32, torch.bfloat16, "awq")


def test_split_k_scratch_needs_no_zeroing(unzeroed_empty):
    # the in-order splits' slots come unzeroed from torch.empty, which the fixture fills with NaN
    check_w4_packed(w4_gemv_variant("gemv"), "cpu", 3, 256, 40, 32, torch.bfloat16, "awq", bias=True, cfg=(16, 4, 3, 1, 1))


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

    gemv = spy("w4_gemv", w4_gemv.w4_gemv_linear)
    monkeypatch.setattr(w4_decode.w4_fast, "w4_packed_linear", spy("w4_fast", w4_decode.w4_fast.w4_packed_linear))
    monkeypatch.setattr(w4_decode, "DECODE_KERNELS", {
        name: None if entry is None else functools.partial(gemv, **entry.keywords)
        for name, entry in w4_decode.DECODE_KERNELS.items()})
    monkeypatch.setattr(w4_decode, "DECODE_KERNEL", kernel)
    monkeypatch.setattr(w4_decode, "DECODE_MAX_ROWS", 4)
    dispatch = type("Dispatch", (), {"w4_packed_linear": staticmethod(
        lambda x, p, bias=None, cfg=None: w4_decode.w4_packed_linear(x, p, bias))})
    check_w4_packed(dispatch, "cpu", rows, 256, 40, 64, torch.bfloat16, "gptq", bias=True)
    assert calls == ["w4_gemv" if kernel != "w4_fast" and rows <= 4 else "w4_fast"]


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("rows, dtype", [(1, torch.bfloat16), (3, torch.float16)])
def test_the_silu_input_formed_in_the_kernel(name, rows, dtype):
    # x = gate | up: the kernel's silu(gate) * up, rounded as silu_mul rounds it, against silu_mul then the GEMV
    from kvrelay.kernels import reference
    from kvrelay.kernels.w4_repack import repack_w4
    from tests.kernels.quant_cases import w4_case

    q, zeros, scales, _, _, b = w4_case(rows, 128, 40, 32, dtype, False, True)
    gate_up = (torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)) * 2).to(dtype)
    packed = repack_w4(quant.pack_w4(q), zeros, scales, 32)
    reduce = {"gemv": "order", "atomic": "atomic", "last": "last"}[name]
    got = w4_gemv.w4_gemv_linear(gate_up, packed, b, reduce=reduce, cfg=(16, 4, 2, 1, 1), silu=True)
    expected = w4_gemv.w4_gemv_linear(reference.silu_mul(gate_up), packed, b, reduce="order", cfg=(16, 4, 2, 1, 1))
    assert got.shape == (rows, 40) and got.dtype == dtype
    # an input rounded one way or the other moves an output by an ulp of the largest (|y| ~ 10: 0.0625 in bf16)
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
    with pytest.raises(ValueError, match=r"the W4 weight 128 \(x2: gate \| up\)"):
        w4_gemv.w4_gemv_linear(gate_up[:, :128], packed, b, silu=True)


@pytest.mark.parametrize("kernel", sorted(w4_decode.DECODE_KERNELS))
@pytest.mark.parametrize("rows", [1, 5])
def test_the_silu_entry_point_whichever_decode_kernel(kernel, rows, monkeypatch):
    # up to DECODE_MAX_ROWS rows a GEMV forms the input, more (and w4_fast) take silu_mul first: the same result
    from kvrelay.kernels import reference
    from kvrelay.kernels.w4_repack import repack_w4
    from tests.kernels.quant_cases import w4_case

    monkeypatch.setattr(w4_decode, "DECODE_KERNEL", kernel)
    q, zeros, scales, _, _, b = w4_case(rows, 128, 40, 32, torch.bfloat16, False, True)
    gate_up = torch.randn(rows, 256, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    packed = repack_w4(quant.pack_w4(q), zeros, scales, 32)
    got = w4_decode.w4_packed_silu_linear(gate_up, packed, b)
    expected = reference.w4_packed_linear(reference.silu_mul(gate_up), packed, b)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=1e-2 * expected.abs().max().item())
