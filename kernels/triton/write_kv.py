"""Reshape-and-cache: scatter this step's K and V rows into the paged KV cache at their slots; into an fp8
cache as value / scale clamped to ±448 (kernels/kv_quant.py)."""

import torch
import triton
import triton.language as tl

from kvrelay.kernels import kv_quant
from kvrelay.kernels.triton.utils import pow2


@triton.jit
def fp8_store_scales(scale_ptr, FP8: tl.constexpr):
    # (K scale, V scale) for stores into an fp8 cache; (1, 1) otherwise (unused)
    if FP8:
        k_scale = tl.load(scale_ptr)
        v_scale = tl.load(scale_ptr + 1)
    else:
        k_scale = 1.0
        v_scale = 1.0
    return k_scale, v_scale


@triton.jit
def _e4m3_grid(x):
    # x (float32, |x| <= 448) rounded to nearest even on e4m3's grid, in float32 arithmetic: 3 mantissa
    # bits, so a step of 2^(e - 3) in binade e, and 2^-9 below the smallest normal (2^-6). The cast that
    # follows is then exact. Triton's interpreter rounds float32 -> fp8 without carrying into the exponent
    # (7.95 became 4.0); the GPU's cast is right, and gets a value it need not round.
    bits = x.to(tl.int32, bitcast=True)
    a = tl.abs(x)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    big = ((e - 3 + 23 + 127) << 23).to(tl.float32, bitcast=True)  # 2^23 steps: a + big rounds a to a step
    r = (a + big) - big
    # x's sign bit onto r (>= 0), so -0 and what rounds to it stay -0 as in torch: a negation compiled
    # on the GPU gave +0 for them
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def from_cache(x, dtype):
    # a K or V tile as loaded from the cache, in the attention's dtype. float8 reaches float32 through
    # float16 (exact: every e4m3 value is an fp16 value), the hardware conversion the 16-bit dtypes use
    if x.dtype == tl.float8e4nv and dtype == tl.float32:
        out = x.to(tl.float16).to(tl.float32)
    else:
        out = x.to(dtype)
    return out


@triton.jit
def to_cache(x, scale, dtype, FP8: tl.constexpr):
    # a K or V value as the cache stores it: x / scale within e4m3's finite range for fp8, else x. The
    # division is IEEE-rounded (div_rn) as torch's is: Triton's `/` and a reciprocal multiply may land a
    # value one ulp off, on the other side of an e4m3 rounding tie, and the bytes would differ from torch's
    if FP8:
        out = _e4m3_grid(tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -448.0, 448.0)).to(dtype)
    else:
        out = x.to(dtype)
    return out


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr, scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_h,
    num_heads, head_dim,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    # one program per token: all [Hkv, D] of its K and V, written only when its slot is not -1
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # the slot check is broadcast through an index tensor: the interpreter rejects scalar-bool masks
    mask = (h[:, None] < num_heads) & (d[None, :] < head_dim) & ((h[:, None] * 0 + slot) >= 0)
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    # block and offset strided separately: a pooled cache is block-major (shared/engine/kv_pool.py); a
    # padding slot (-1) computes a negative address that the mask never touches
    dst = cache_ptr + (slot // PAGE) * stride_c_block + (slot % PAGE) * stride_c_slot + h[:, None] * stride_c_h + d[None, :]
    k_scale, v_scale = fp8_store_scales(scale_ptr, FP8)
    tl.store(dst, to_cache(k, k_scale, cache_ptr.dtype.element_ty, FP8), mask=mask)
    tl.store(dst + stride_c_kv, to_cache(v, v_scale, cache_ptr.dtype.element_ty, FP8), mask=mask)


def scale_arg(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The kernels' scale pointer: ``kv_scale`` for an fp8 cache (float32 [2], ones when None), else any
    tensor (the FP8=False variants never read it)."""
    if not kv_quant.is_fp8(kv_cache):
        return like
    if kv_scale is None:
        return torch.ones(2, dtype=torch.float32, device=kv_cache.device)
    assert kv_scale.dtype == torch.float32 and kv_scale.numel() == 2 and kv_scale.is_contiguous()
    return kv_scale


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scale: torch.Tensor | None = None) -> None:
    # k, v: [T, Hkv, D] (any token/head strides, unit stride in D); kv_cache: [2, N, bs, Hkv, D];
    # kv_scale: float32 [2] (K, V) of an fp8 cache
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    assert kv_cache.stride(-1) == 1
    bh, bd = pow2(num_heads), pow2(head_dim)
    _write_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping, scale_arg(kv_cache, kv_scale, k),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        num_heads, head_dim,
        PAGE=kv_cache.shape[2], BLOCK_H=bh, BLOCK_D=bd, FP8=kv_quant.is_fp8(kv_cache),
        num_warps=min(8, max(1, bh * bd // 512)),
    )
