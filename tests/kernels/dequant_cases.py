"""Checks shared by the interpreter and GPU tests of whole-weight dequantization (kernels/triton/dequant.py)
and of the row-count dispatch over it (kernels/triton/dequant_linear.py).

``LAYOUTS``: "packed" (the W4 layout repacked at load, kernels/w4_repack.py; act-order sorted), "plain" (the
W4 layout as is, act-order's g_idx read per row) and "int8" (per channel). ``layer(layout, ...)`` draws one
weight as tests/kernels/quant_cases.py does (values on the host, the same on every device) and returns the
dispatch op over it, the kernel's own dequantization, the reference's, and the fused kernel the op takes
below the threshold.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvrelay.kernels import quant
from kvrelay.kernels.w4_repack import dequantize_packed, repack_w4
from tests.kernels.quant_cases import full_fp32, w4_case
from tests.kernels.triton_cases import assert_close

LAYOUTS = ["packed", "plain", "int8"]
DEQUANT_FN = {"packed": "dequantize_w4_packed", "plain": "dequantize_w4", "int8": "dequantize_channel"}


@dataclass
class Layer:
    op: Callable  # x, bias -> y: the registered op (dequant_linear's)
    fused: Callable  # x, bias -> y: the fused kernel below the threshold
    dequantized: Callable  # dtype -> the kernel's [N, K] weight
    reference: Callable  # dtype -> kernels/quant.py's (or w4_repack.py's) [N, K] weight
    n: int


def kernel_modules():
    """(dequant, dequant_linear) as imported now: an interpreted test module's collection drops every
    kvrelay.kernels.triton module (tests/kernels/interpreted.py), so a spy must patch the modules that
    ``layer``'s ops, imported at run time, call."""
    from kvrelay.kernels.triton import dequant, dequant_linear

    return dequant, dequant_linear


def layer(layout: str, device: str, k: int, n: int, group: int = 64, act_order: bool = False) -> Layer:
    from kvrelay.kernels.triton import w4_decode, w4a16

    dequant, dequant_linear = kernel_modules()

    if layout == "int8":
        gen = torch.Generator().manual_seed(k + n)
        w, s = quant.quantize_channel((torch.randn(n, k, generator=gen) / k ** 0.5).to(device), "int8")
        return Layer(lambda x, b: dequant_linear.int8_linear(x, w, s, b), lambda x, b: w4a16.int8_linear(x, w, s, b),
                     lambda dt: dequant.dequantize_channel(w, s, dt), lambda dt: quant.dequantize_channel(w, s, dt), n)
    q, zeros, scales, g_idx, _, _ = w4_case(1, k, n, group, torch.float32, act_order, False)
    qweight, zeros, scales = quant.pack_w4(q).to(device), zeros.to(device), scales.to(device)
    g_idx = g_idx.to(device) if g_idx is not None else None
    if layout == "packed":
        p = repack_w4(qweight, zeros, scales, group, g_idx)
        return Layer(lambda x, b: dequant_linear.w4_packed_linear(x, p, b),
                     lambda x, b: w4_decode.w4_packed_linear(x, p, b),
                     lambda dt: dequant.dequantize_w4_packed(p, dt).t(), lambda dt: dequantize_packed(p, dt), n)
    return Layer(lambda x, b: dequant_linear.w4a16_linear(x, qweight, zeros, scales, group, g_idx, b),
                 lambda x, b: w4a16.w4a16_linear(x, qweight, zeros, scales, group, g_idx, b),
                 lambda dt: dequant.dequantize_w4(qweight, zeros, scales, group, g_idx, dt).t(),
                 lambda dt: quant.dequantize_w4(qweight, zeros, scales, group, g_idx, dt), n)


def check_dequantized(lay: Layer, dtype: torch.dtype) -> None:
    """The kernel's weight is the reference's, bit for bit (one fp32 product, rounded once)."""
    got, expected = lay.dequantized(dtype), lay.reference(dtype)
    assert got.dtype == dtype and got.shape == expected.shape
    assert torch.equal(got, expected), f"{(got.float() - expected.float()).abs().max()} off"


def inputs(rows: int, k: int, n: int, dtype: torch.dtype, device: str, bias: bool):
    gen = torch.Generator().manual_seed(rows * 7 + k)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(device)
    return x, (torch.randn(n, generator=gen).to(dtype).to(device) if bias else None)


def check_many_rows(lay: Layer, rows: int, k: int, dtype: torch.dtype, device: str, bias: bool = True) -> None:
    """At or above the threshold the op is the reference linear: dequantize-then-matmul in fp32, within the
    activation dtype's tolerance."""
    x, b = inputs(rows, k, lay.n, dtype, device, bias)
    got = lay.op(x, b)
    with full_fp32():
        expected = F.linear(x.float(), lay.reference(torch.float32), b.float() if b is not None else None)
    assert got.dtype == dtype and got.shape == (rows, lay.n)
    assert_close(got, expected, dtype)


def check_few_rows(lay: Layer, rows: int, k: int, dtype: torch.dtype, device: str, bias: bool = True) -> None:
    """Below the threshold the op is the fused kernel, bit for bit."""
    x, b = inputs(rows, k, lay.n, dtype, device, bias)
    assert torch.equal(lay.op(x, b), lay.fused(x, b))


def count_calls(monkeypatch, module, name: str) -> list:
    """Each call of ``module.name`` appends to the returned list, and still runs it."""
    calls: list = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(name) or real(*a, **kw))
    return calls
