"""Reshape-and-cache: scatter this step's K and V rows into the paged KV cache at their slots."""

import torch
import triton
import triton.language as tl

from kvrelay.kernels.triton.utils import pow2


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_h,
    num_heads, head_dim,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
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
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    # k, v: [T, Hkv, D] (any token/head strides, unit stride in D); kv_cache: [2, N, bs, Hkv, D]
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
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        num_heads, head_dim,
        PAGE=kv_cache.shape[2], BLOCK_H=bh, BLOCK_D=bd, num_warps=min(8, max(1, bh * bd // 512)),
    )
