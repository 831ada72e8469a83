"""Kernel entry points. Each op runs its Triton kernel on CUDA when one is registered for it, its
CPU kernel on the CPU when there is one (kernels/cpu_attention.py), and the plain-torch reference
(kernels/reference.py) everywhere else.

Triton modules register with ``register("op_name", fn)`` (kernels/registry.py); callers only ever import
the names below, so kernels drop in without touching the models.
"""

import os

import torch

from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.kernels.registry import fused, implementation, register

# kv_scale (write_kv, paged_attention, rotary_*): a layer's [2] float32 (K scale, V scale) for an fp8 KV
# cache (kernels/kv_quant.py: stored = x / scale, read = stored * scale); None is scale 1. Other caches
# ignore it.


def write_kv(k, v, kv_cache, slot_mapping, kv_scale=None):
    return implementation("write_kv", k)(k, v, kv_cache, slot_mapping, kv_scale)


def paged_attention(q, kv_cache, meta: AttentionMetadata, scale: float, alibi_slopes=None, k=None, v=None,
                    kv_scale=None):
    # k, v (optional): this step's keys/values, already written to kv_cache; a kernel may read them
    # from there instead of through the block table (the reference ignores them)
    return implementation("paged_attention", q)(q, kv_cache, meta, scale, alibi_slopes, k=k, v=v, kv_scale=kv_scale)


def rms_norm(x, weight, eps, residual=None):
    return implementation("rms_norm", x)(x, weight, eps, residual)


def layer_norm(x, weight, bias, eps):
    return implementation("layer_norm", x)(x, weight, bias, eps)


def rotary_embedding(positions, q, k, cos_sin_cache):
    return implementation("rotary_embedding", q)(positions, q, k, cos_sin_cache)


def rotary_write_kv(positions, q, k, v, cos_sin_cache, kv_cache, slot_mapping, kv_scale=None):
    # rotary on q and k, then k and v into the paged cache; returns the rotated (q, k). One kernel on GPU
    return implementation("rotary_write_kv", q)(positions, q, k, v, cos_sin_cache, kv_cache, slot_mapping,
                                                kv_scale)


def rotary_attention(positions, q, k, v, cos_sin_cache, kv_cache, meta: AttentionMetadata, scale: float,
                     kv_scale=None):
    # rotary on q and k, k and v into the paged cache, then attention over it -> [T, H, D]. On GPU a decode
    # step runs all of it in the attention kernel (kernels/triton/decode_attention.py)
    kernel = fused("rotary_attention", q)
    if kernel is not None:
        return kernel(positions, q, k, v, cos_sin_cache, kv_cache, meta, scale, kv_scale)
    q, k = rotary_write_kv(positions, q, k, v, cos_sin_cache, kv_cache, meta.slot_mapping, kv_scale)
    return paged_attention(q, kv_cache, meta, scale, k=k, v=v, kv_scale=kv_scale)


def copy_blocks(src, src_ids, dst, dst_ids, layers):
    # dst[layers][:, :, dst_ids] = src[layers][:, :, src_ids] between two [L, 2, N, bs, Hkv, D] caches
    return implementation("copy_blocks", src)(src, src_ids, dst, dst_ids, layers)


def silu_mul(x):
    return implementation("silu_mul", x)(x)


def linear(x, weight, bias=None):
    return implementation("linear", x)(x, weight, bias)


def rms_norm_linear(x, residual, norm_weight, eps, weight, bias=None):
    # linear(rms_norm(x + residual)) and the new residual stream: one kernel for a few-token step on GPU
    return implementation("rms_norm_linear", x)(x, residual, norm_weight, eps, weight, bias)


def silu_mul_linear(x, weight, bias=None):
    # linear(silu(gate) * up) of x = gate | up: one kernel for a few-token step on GPU
    return implementation("silu_mul_linear", x)(x, weight, bias)


def w4a16_linear(x, qweight, zeros, scales, group_size, g_idx=None, bias=None):
    # 4-bit group-quantized weight (kernels/quant.py's W4 layout: AWQ and GPTQ convert to it at load)
    return implementation("w4a16_linear", x)(x, qweight, zeros, scales, group_size, g_idx, bias)


def w4_packed_linear(x, packed, bias=None):
    # the W4 weight repacked at load (kernels/w4_repack.py: interleaved nibbles, groups in order)
    return implementation("w4_packed_linear", x)(x, packed, bias)


def int8_linear(x, weight, scale, bias=None):
    # int8 [N, K] weight, fp32 per-output-channel scale [N]; activations stay in x's dtype
    return implementation("int8_linear", x)(x, weight, scale, bias)


def fp8_linear(x, weight, scale, bias=None):
    # float8_e4m3fn [N, K] weight, fp32 per-output-channel scale [N]
    return implementation("fp8_linear", x)(x, weight, scale, bias)


def rms_norm_fp8_linear(x, residual, norm_weight, eps, weight, scale, bias=None):
    # fp8_linear(rms_norm(x + residual)) and the new residual stream: on GPU the norm writes the e4m3 rows the
    # FP8 matmul reads (kernels/triton/fp8_prologue.py)
    return implementation("rms_norm_fp8_linear", x)(x, residual, norm_weight, eps, weight, scale, bias)


def silu_mul_fp8_linear(x, weight, scale, bias=None):
    # fp8_linear(silu(gate) * up) of x = gate | up, the product quantized where it is formed on GPU
    return implementation("silu_mul_fp8_linear", x)(x, weight, scale, bias)


def warm_up_prefill_attention(q_like, num_kv_heads, max_len, max_tokens):
    # runs once what the first prompts of each length up to max_len, in steps of at most max_tokens, would
    # otherwise wait for (cuDNN's per-shape plans, kernels/sdpa_prefill.py); returns how many shapes, 0 where
    # nothing needs it
    return implementation("warm_up_prefill_attention", q_like)(q_like, num_kv_heads, max_len, max_tokens)


def gelu(x, approximate="tanh"):
    return implementation("gelu", x)(x, approximate)


__all__ = [
    "AttentionMetadata", "register", "write_kv", "paged_attention", "rms_norm", "layer_norm",
    "rotary_embedding", "rotary_write_kv", "rotary_attention", "copy_blocks", "silu_mul", "gelu", "linear", "rms_norm_linear",
    "silu_mul_linear", "warm_up_prefill_attention", "w4a16_linear", "w4_packed_linear", "int8_linear",
    "fp8_linear", "rms_norm_fp8_linear", "silu_mul_fp8_linear",
]


def _register_triton() -> None:
    # KVRELAY_KERNELS=reference keeps the torch references on CUDA too (the unfused baseline in benchmarks)
    if os.environ.get("KVRELAY_KERNELS", "triton") != "triton" or not torch.cuda.is_available():
        return
    try:
        from kvrelay.kernels.triton import register_all
    except ImportError:  # no triton on this CUDA machine: the references still work
        return
    register_all()


_register_triton()
