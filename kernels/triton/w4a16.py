"""Weight-only quantized matmuls: W4A16 (AWQ/GPTQ) and W8A16 (int8), in kernels/quant.py's layouts.

The weight is dequantized tile by tile in registers, so the full-precision weight never exists in
memory: a decode step reads 4 (or 8) bits per weight instead of 16. Two shapes:

- GEMV (a few rows, decode): one program per ``BLOCK_N`` outputs of one row; the products of a
  [BLOCK_K, BLOCK_N] tile pile up elementwise and are reduced once at the end, so the loop is loads,
  shifts and FMAs (the form kernels/triton/skinny_linear.py measured fastest for one row).
- GEMM (prefill): [BLOCK_M, BLOCK_N] output tiles, ``tl.dot`` on the dequantized tile in the
  activation dtype with fp32 accumulation.

W4 tiles load the packed words once ([BLOCK_K/8, BLOCK_N]) and unpack them by broadcasting the eight
shifts, which yields the [BLOCK_K, BLOCK_N] tile in k order. Without ``g_idx`` and with the group size a
multiple of BLOCK_K, a tile lies in one group and its zeros and scales are one row ([BLOCK_N]); with
act-order ``g_idx`` they are gathered per input row.
"""

import torch
import triton
import triton.language as tl

from kvrelay.kernels.triton import skinny_linear
from kvrelay.kernels.triton.decode_attention import _dot
from kvrelay.kernels.triton.utils import interpreting

W4, INT8 = 0, 1
GEMV_MAX_ROWS = 8  # rows up to which each row streams the weight on its own; above, tiles share it


@triton.jit
def _weight_tile(w_ptr, z_ptr, s_ptr, g_ptr, k0, rn, n_mask, N, K, G,
                 FORMAT: tl.constexpr, HAS_GIDX: tl.constexpr, ONE_GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    # the [BLOCK_K, BLOCK_N] fp32 weight tile for inputs k0.. and outputs rn (int8: unscaled; the
    # per-channel scale is applied to the sums)
    rk = k0 + tl.arange(0, BLOCK_K)
    k_mask = rk < K
    # one return at the end, the formats in exclusive branches: Triton compiles every statement after a
    # constexpr branch that returns, and the W4 loads cannot even be typed against an fp8 pointer
    if FORMAT == 1:
        q = tl.load(w_ptr + rn[None, :].to(tl.int64) * K + rk[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        w = q.to(tl.float16).to(tl.float32)  # exact for int8 and e4m3, which convert to fp16 in hardware
    else:
        rw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(w_ptr + rw[:, None].to(tl.int64) * N + rn[None, :],
                        mask=(rw < K // 8)[:, None] & n_mask[None, :], other=0)  # [BK/8, BN]
        shifts = tl.arange(0, 8) * 4
        q = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [BK/8, 8, BN]
        q = tl.reshape(q, (BLOCK_K, BLOCK_N)).to(tl.float32)
        if ONE_GROUP:
            g = k0 // G
            z = tl.load(z_ptr + g * N + rn, mask=n_mask, other=0).to(tl.float32)
            s = tl.load(s_ptr + g * N + rn, mask=n_mask, other=0).to(tl.float32)
            w = (q - z[None, :]) * s[None, :]
        else:
            if HAS_GIDX:
                g = tl.load(g_ptr + rk, mask=k_mask, other=0)
            else:
                g = rk // G
            gm = k_mask[:, None] & n_mask[None, :]
            z = tl.load(z_ptr + g[:, None].to(tl.int64) * N + rn[None, :], mask=gm, other=0).to(tl.float32)
            s = tl.load(s_ptr + g[:, None].to(tl.int64) * N + rn[None, :], mask=gm, other=0).to(tl.float32)
            w = (q - z) * s
    return w


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, z_ptr, s_ptr, g_ptr, b_ptr, y_ptr, N, K, G, stride_x, stride_y,
                 FORMAT: tl.constexpr, HAS_GIDX: tl.constexpr, ONE_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, row = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    acc = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + rk, mask=rk < K, other=0.0).to(tl.float32)
        w = _weight_tile(w_ptr, z_ptr, s_ptr, g_ptr, k0, rn, n_mask, N, K, G, FORMAT, HAS_GIDX, ONE_GROUP, BLOCK_N, BLOCK_K)
        acc += x[:, None] * w
    y = tl.sum(acc, axis=0)
    if FORMAT == 1:
        y *= tl.load(s_ptr + rn, mask=n_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, z_ptr, s_ptr, g_ptr, b_ptr, y_ptr, M, N, K, G, stride_x, stride_y,
                 FORMAT: tl.constexpr, HAS_GIDX: tl.constexpr, ONE_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                 UPCAST: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + rk[None, :],
                    mask=m_mask[:, None] & (rk < K)[None, :], other=0.0)
        w = _weight_tile(w_ptr, z_ptr, s_ptr, g_ptr, k0, rn, n_mask, N, K, G, FORMAT, HAS_GIDX, ONE_GROUP, BLOCK_N, BLOCK_K)
        # fp32 activations: IEEE, no TF32 rounding; the interpreter: UPCAST (kernels/triton/utils.py)
        acc += _dot(x, w.to(dtype), UPCAST, IEEE)
    if FORMAT == 1:
        acc *= tl.load(s_ptr + rn, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_y + rn[None, :], acc.to(dtype),
             mask=m_mask[:, None] & n_mask[None, :])


def gemv_config(n: int, group_size: int, grouped: bool) -> tuple[int, int, int]:
    """(1, BLOCK_N, BLOCK_K) of a decode row: enough programs to fill a large GPU (N / BLOCK_N >= ~512 at
    Llama-3-8B's widths: a weight-bound loop needs many in flight per SM), and a K tile of one whole group
    where the group size allows, so each tile reads one row of scales and zero points. A first choice, not
    a measured one: ``kvrelay bench quant`` on a GPU is what to tune it against."""
    block_n = 32 if n >= 16384 else 16 if n >= 8192 else 8
    one_group = grouped and 8 <= group_size <= 256 and group_size & (group_size - 1) == 0
    return 1, block_n, group_size if one_group else 128


def _launch(fmt: int, x: torch.Tensor, w: torch.Tensor, zeros: torch.Tensor | None, scales: torch.Tensor,
            g_idx: torch.Tensor | None, group_size: int, n: int, bias: torch.Tensor | None,
            gemv: bool | None, cfg: tuple[int, ...] | None) -> torch.Tensor:
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    gemv = m <= GEMV_MAX_ROWS if gemv is None else gemv
    block_m, block_n, block_k, *launch = cfg or (gemv_config(n, group_size, g_idx is None and fmt == W4) if gemv
                                                 else (64 if m > 32 else 16, 64, 64))
    one_group = fmt == W4 and g_idx is None and group_size % block_k == 0
    args = (x2, w, zeros if zeros is not None else scales, scales, g_idx if g_idx is not None else scales,
            bias if bias is not None else scales, y)
    flags = dict(FORMAT=fmt, HAS_GIDX=g_idx is not None, ONE_GROUP=one_group, HAS_BIAS=bias is not None,
                 BLOCK_N=block_n, BLOCK_K=block_k)
    if launch:  # (num_warps, num_stages) where a sweep sets them
        flags.update(num_warps=launch[0], num_stages=launch[1])
    if gemv:
        _gemv_kernel[(triton.cdiv(n, block_n), m)](*args, n, k, group_size, x2.stride(0), y.stride(0), **flags)
    else:
        _gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            *args, m, n, k, group_size, x2.stride(0), y.stride(0), UPCAST=interpreting(), IEEE=x.dtype == torch.float32,
            BLOCK_M=block_m, **flags)
    return y.view(*x.shape[:-1], n)


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                 group_size: int, g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
                 gemv: bool | None = None, cfg: tuple[int, ...] | None = None) -> torch.Tensor:
    """x [..., K] @ W4 weight (qweight int32 [K/8, N]) -> [..., N]. ``gemv``/``cfg`` (BLOCK_M, BLOCK_N,
    BLOCK_K; BLOCK_K a multiple of 8; optionally num_warps, num_stages) force a shape for tests and
    sweeps; by default the row count picks."""
    return _launch(W4, x, qweight, zeros, scales, g_idx, group_size, qweight.shape[1], bias, gemv, cfg)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                gemv: bool | None = None, cfg: tuple[int, ...] | None = None) -> torch.Tensor:
    """x [..., K] @ (int8 [N, K] * scale [N]).T -> [..., N]. An fp8 (e4m3) weight in the same layout
    reads the same way (its weight-only form). One row, unless forced, takes skinny_linear's loop."""
    if gemv is None and cfg is None and skinny_linear.supports_scaled(x, weight):
        return skinny_linear.scaled_linear(x, weight, scale, bias)
    return _launch(INT8, x, weight, None, scale, None, 1, weight.shape[0], bias, gemv, cfg)
