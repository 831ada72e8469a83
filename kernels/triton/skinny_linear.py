"""Linear layers of a one-token step (batch-1 decode), with the op before them fused in.

A batch-1 decode step is bound by reading the weights, and the RMSNorm or SiLU*mul before a projection
is a kernel of its own whose launch and round trip through memory cost as much as its work. Here one
program owns ``BLOCK_N`` output features, streams their weight rows once, and computes its own copy of
the (one-row) input on the fly:

- ``NORM`` / ``ADD_NORM``: RMSNorm of x (after adding the residual stream, whose sum program 0 writes
  back), rounded as kernels.reference.rms_norm rounds it, so the projection sees the same bf16 values
  it would unfused;
- ``SILU``: SiLU(gate) * up of a [1, 2K] input, rounded as the reference rounds it;
- ``NONE``: a plain linear (o_proj).

Measured against cuBLAS on an H200 (bench/skinny_probe.py): a loop of loads and FMAs beat tl.dot tiles
padded to 16 rows at every Llama-3-8B shape but the LM head, and with 16 rows the per-program prologue
lost to the unfused ops; so one row only, fp16/bf16 only (fp32 keeps cuBLAS, whose results the fp32
equality tests with HF pin down).
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvrelay.kernels.triton.rms_norm import rms_norm
from kvrelay.kernels.triton.silu_mul import silu_mul

NONE, NORM, ADD_NORM, SILU = 0, 1, 2, 3


@triton.jit
def _input_chunk(x_ptr, r_ptr, nw_ptr, cols, mask, K, rstd, PROLOGUE: tl.constexpr, DTYPE: tl.constexpr):
    # columns ``cols`` of the projection's input, rounded exactly as the unfused ops round them
    if PROLOGUE == 3:  # SILU: x is gate | up, 2K wide
        g = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + K + cols, mask=mask, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
        return (act * u).to(DTYPE)
    x = tl.load(x_ptr + cols, mask=mask, other=0.0)
    if PROLOGUE == 2:  # torch's `x + residual` rounds the sum to the stream's dtype before the norm
        x = (x.to(tl.float32) + tl.load(r_ptr + cols, mask=mask, other=0.0).to(tl.float32)).to(DTYPE)
    if PROLOGUE == 1 or PROLOGUE == 2:
        nw = tl.load(nw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = ((x.to(tl.float32) * rstd).to(DTYPE).to(tl.float32) * nw).to(DTYPE)
    return x


@triton.jit
def _skinny_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, y_ptr, r_out_ptr, N, K, eps,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # x: [K] ([2K] for SILU); w: [N, K]; y: [N]. The input row is broadcast over BLOCK_N weight rows;
    # products pile up in [BLOCK_N, BLOCK_K] and are reduced once at the end: the loop is loads and FMAs.
    # SCALED: w is int8 or fp8 (e4m3) with a float32 scale per output row (kernels/quant.py), applied to
    # the sums; the weight read is then half a bf16 one
    pid = tl.program_id(0)
    dtype = y_ptr.dtype.element_ty
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rstd = 1.0
    if PROLOGUE == 1 or PROLOGUE == 2:  # the row's 1 / rms; program 0 also stores x + residual
        ss = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = cols < K
            x = tl.load(x_ptr + cols, mask=mask, other=0.0)
            if PROLOGUE == 2:
                x = (x.to(tl.float32) + tl.load(r_ptr + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype)
                tl.store(r_out_ptr + cols, x, mask=cols < tl.where(pid == 0, K, 0))
            xf = x.to(tl.float32)
            ss += xf * xf
        rstd = tl.math.rsqrt(tl.sum(ss, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        k_mask = cols < K
        x = _input_chunk(x_ptr, r_ptr, nw_ptr, cols, k_mask, K, rstd, PROLOGUE, dtype)  # [BK]
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + cols[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # [BN, BK]
        if SCALED:  # e4m3 and int8 are exact in fp16, which both convert to in hardware
            w = w.to(tl.float16)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if SCALED:
        y *= tl.load(s_ptr + rn, mask=n_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(dtype), mask=n_mask)


# Weights wider than this keep the unfused ops: every program recomputes the prologue over the input
# row, and with thousands of programs (gate_up: 3,584) those L2 reads cost more than the launch saved;
# cuBLAS already reads such weights at the copy rate (bench/skinny_probe.py, BENCHMARKS.md).
MAX_FEATURES = 8192


def config(n: int, k: int, elem_bytes: int = 2) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): for 16-bit weights about a thousand programs, 8-16 KB of weight per
    loop step. An 8-bit weight (fp8, int8) converts every element before its FMA, so its programs are
    small (2 KB a step, 2 warps) and many, to keep more loads in flight per SM: at one row on an H100 the
    16-bit shapes doubled in width ran gate_up 20% slower (bench/quant_kernels.py, BENCHMARKS.md)."""
    if elem_bytes == 1:
        return (2, 2048, 4) if k > 8192 else (4, 512, 2)
    return (4, 1024, 4) if k > 8192 else (8, 512, 4)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused kernel takes this call; otherwise the caller runs the unfused ops."""
    return (x.numel() == x.shape[-1] and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
            and weight.shape[0] <= MAX_FEATURES and weight.is_contiguous())


def supports_scaled(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether one row against an int8 / fp8 weight (kernels/quant.py's [N, K] layout) takes the kernel."""
    return (x.is_cuda and x.numel() == x.shape[-1] and x.dtype in (torch.float16, torch.bfloat16)
            and weight.dtype in (torch.int8, torch.float8_e4m3fn) and weight.is_contiguous())


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  prologue: int = NONE, residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                  eps: float = 1e-6, cfg: tuple[int, int, int] | None = None, scale: torch.Tensor | None = None
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """y = prologue(x) @ weight.T + bias for one row of x.

    x: [..., K] ([..., 2K] with SILU) holding one row; weight: [N, K] in x's dtype, or int8 / fp8 with
    ``scale`` float32 [N]; residual: [..., K] with ADD_NORM, which returns (y, x + residual) like
    kernels.rms_norm's fused form."""
    n, k = weight.shape
    x2 = x.reshape(1, x.shape[-1]).contiguous()
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    r2 = residual.reshape(1, k).contiguous() if residual is not None else x2
    r_out = torch.empty((1, k), dtype=x.dtype, device=x.device) if prologue == ADD_NORM else y
    nw = norm_weight if norm_weight is not None else weight
    block_n, block_k, warps = cfg or config(n, k, weight.element_size())
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x2, r2, nw, weight, scale if scale is not None else x2, bias if bias is not None else x2, y, r_out, n, k, eps,
        PROLOGUE=prologue, HAS_BIAS=bias is not None, SCALED=scale is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps,
    )
    y = y.view(*x.shape[:-1], n)
    return (y, r_out.view(*x.shape[:-1], k)) if prologue == ADD_NORM else y


def scaled_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                  cfg: tuple[int, int, int] | None = None) -> torch.Tensor:
    """One row of x against an int8 / fp8 weight with per-row scales (``supports_scaled``)."""
    return skinny_linear(x, weight, bias, scale=scale, cfg=cfg)


# -- the ops kernels/__init__.py dispatches to on CUDA ----------------------------------------------------
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return skinny_linear(x, weight, bias) if supports(x, weight) else F.linear(x, weight, bias)


def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    fused = supports(x, weight) and norm_weight.dtype == x.dtype
    if residual is None:
        if fused:
            return skinny_linear(x, weight, bias, prologue=NORM, norm_weight=norm_weight, eps=eps), x
        return F.linear(rms_norm(x, norm_weight, eps), weight, bias), x
    if fused:
        return skinny_linear(x, weight, bias, prologue=ADD_NORM, residual=residual, norm_weight=norm_weight, eps=eps)
    normed, residual = rms_norm(x, norm_weight, eps, residual)
    return F.linear(normed, weight, bias), residual


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if supports(x, weight):
        return skinny_linear(x, weight, bias, prologue=SILU)
    return F.linear(silu_mul(x), weight, bias)
