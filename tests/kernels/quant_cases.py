"""Checks shared by the interpreter and GPU tests of the weight-only quantized matmuls: a random
quantized weight, the kernel's output against the reference in kernels/quant.py (dequantize, then
matmul in fp32), with the tolerance of the activation dtype.

The values are drawn on the host (the same on every device); the format conversions and the reference run
on the kernel's device. On a GPU that is torch's fp32 matmul with TF32 off, the same sum as the host's in
another order; on the host a Llama-3-8B projection's dequantize-and-matmul was most of each GPU test's time.
"""

import contextlib
import functools

import torch

from kvrelay.kernels import quant
from tests.kernels.triton_cases import assert_close


def w4_case(rows: int, k: int, n: int, group: int, dtype: torch.dtype, act_order: bool, bias: bool):
    """(q [K, N] values 0..15, zero points, fp16 scales, g_idx or None, x [rows, K], bias or None)."""
    gen = torch.Generator().manual_seed(rows * 131 + k + n + group)
    q = torch.randint(0, 16, (k, n), generator=gen).to(torch.int32)  # what pack_w4 takes: half the bytes of int64
    zeros = torch.randint(0, 16, (k // group, n), generator=gen).to(torch.uint8)
    # scales ~ 1/sqrt(K) keep the outputs O(1), where the dtype tolerances are calibrated
    scales = (torch.rand(k // group, n, generator=gen) * 0.5 / k ** 0.5 + 0.01 / k ** 0.5).half()
    g_idx = (torch.randperm(k, generator=gen) // group).to(torch.int32) if act_order else None
    x = torch.randn(rows, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return q, zeros, scales, g_idx, x, b


@contextlib.contextmanager
def full_fp32():
    """CUDA matmuls in fp32 as the host does them: a reference must not round its inputs to TF32's 10 bits."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _on(device: str, *tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [t.to(device) if t is not None else None for t in tensors]


def _release(device: str) -> None:
    # a reference at a Llama-3-8B shape holds a few GB while it runs; the suite runs a dozen processes on one GPU,
    # and memory a process keeps cached is memory the others' engines cannot size their KV caches from
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def check_w4(kernel, device: str, rows: int, k: int, n: int, group: int, dtype: torch.dtype, act_order: bool,
             gemv: bool | None = None, bias: bool = False, cfg: tuple[int, int, int] | None = None) -> None:
    q, zeros, scales, g_idx, x, b = _on(device, *w4_case(rows, k, n, group, dtype, act_order, bias))
    qweight = quant.pack_w4(q)
    got = kernel.w4a16_linear(x, qweight, zeros, scales, group, g_idx, b, gemv=gemv, cfg=cfg)
    with full_fp32():
        expected = quant.w4a16_linear(x.float(), qweight, zeros, scales, group, g_idx,
                                      b.float() if b is not None else None)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert_close(got, expected, dtype)
    _release(device)


def check_int8(kernel, device: str, rows: int, k: int, n: int, dtype: torch.dtype, gemv: bool | None = None,
               kind: str = "int8", op=None) -> None:
    """An int8 or fp8 (e4m3) per-channel weight through ``op`` (default: the kernel's int8_linear, which
    reads both) against dequantize-then-matmul in fp32."""
    gen = torch.Generator().manual_seed(rows + k + n)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w, x = _on(device, w, x)
    weight, scale = quant.quantize_channel(w / k ** 0.5, kind)
    got = kernel.int8_linear(x, weight, scale, gemv=gemv) if op is None else op(x, weight, scale)
    with full_fp32():
        expected = quant.int8_linear(x.float(), weight, scale)
    assert_close(got, expected, dtype)
    _release(device)


def check_w4_packed(kernel, device: str, rows: int, k: int, n: int, group: int, dtype: torch.dtype,
                    source: str, bias: bool = False, cfg: tuple[int, ...] | None = None) -> None:
    """A W4 weight published as ``source`` ("awq", "gptq", "gptq_act_order"; "w4_act_order": kernels/quant.py's
    layout as is, which, packing along K only, allows any output count), converted to the W4 layout as the
    loader does, repacked (kernels/w4_repack.py), through ``kernel.w4_packed_linear`` against
    dequantize-then-matmul of the original values."""
    from kvrelay.kernels.w4_repack import repack_w4
    from kvrelay.shared.engine.quant import formats

    q, zeros, scales, g_idx, x, b = _on(device, *w4_case(rows, k, n, group, dtype, source.endswith("act_order"), bias))
    if source.startswith("w4"):
        qweight = quant.pack_w4(q)
    elif source == "awq":
        awq = formats.to_awq(q, zeros, scales)
        qweight, zeros = formats.awq_qweight_to_w4(awq["qweight"]), formats.awq_qzeros_to_w4(awq["qzeros"])
    else:
        gptq = formats.to_gptq(q, zeros.int(), scales, group)
        qweight, zeros = gptq["qweight"], formats.gptq_qzeros_to_w4(gptq["qzeros"], minus_one=True)
        g_idx = gptq["g_idx"].to(device) if g_idx is None else g_idx  # made on the host
    packed = repack_w4(qweight, zeros, scales, group, g_idx)
    got = kernel.w4_packed_linear(x, packed, b, cfg=cfg)
    with full_fp32():
        expected = quant.w4a16_linear(x.float(), quant.pack_w4(q), zeros, scales, group, g_idx,
                                      b.float() if b is not None else None)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert_close(got, expected, dtype)
    _release(device)


def w4_gemv_variant(name: str):
    """A stand-in module whose ``w4_packed_linear`` (what ``check_w4_packed`` calls) is one of kernels/triton/
    w4_gemv.py's split-K sums: "gemv" (in order) or "atomic" (by fp32 atomics)."""
    from kvrelay.kernels.triton import w4_gemv

    run = functools.partial(w4_gemv.w4_gemv_linear, atomic={"gemv": False, "atomic": True}[name])
    return type("Variant", (), {"w4_packed_linear": staticmethod(run)})
