"""Triton implementations of the ops in kernels/__init__.py, one module per kernel.

``register_all()`` installs them into the dispatcher (kernels/registry.py); call it once on a CUDA machine where ``triton``
imports. Tests call the module functions directly (also on CPU under ``TRITON_INTERPRET=1``).

The names imported below shadow their modules: ``kvrelay.kernels.triton.rms_norm`` (and fp8_linear, silu_mul,
layer_norm, gelu, copy_blocks, paged_attention, write_kv) is the function once this package has loaded. Code that
sets a kernel module's constant must take the module from ``importlib.import_module("kvrelay.kernels.triton.X")``;
an attribute set on the function changes nothing.
"""

from kvrelay.kernels import sdpa_prefill
from kvrelay.kernels.registry import register
from kvrelay.kernels.triton.copy_blocks import copy_blocks
from kvrelay.kernels.triton.dequant_linear import int8_linear, w4_packed_linear, w4a16_linear
from kvrelay.kernels.triton.fp8_linear import fp8_linear, rms_norm_fp8_linear, silu_mul_fp8_linear
from kvrelay.kernels.triton.gelu import gelu
from kvrelay.kernels.triton.layer_norm import layer_norm
from kvrelay.kernels.triton.paged_attention import paged_attention, rotary_attention
from kvrelay.kernels.triton.rms_norm import rms_norm
from kvrelay.kernels.triton.rotary import rotary_embedding, rotary_write_kv
from kvrelay.kernels.triton.sampling import filter_logits, sample_from_logits
from kvrelay.kernels.triton.silu_mul import silu_mul
from kvrelay.kernels.triton.skinny_linear import linear, rms_norm_linear, silu_mul_linear
from kvrelay.kernels.triton.write_kv import write_kv

OPS = {
    "write_kv": write_kv,
    "paged_attention": paged_attention,
    "rms_norm": rms_norm,
    "layer_norm": layer_norm,
    "rotary_embedding": rotary_embedding,
    "rotary_write_kv": rotary_write_kv,
    "rotary_attention": rotary_attention,
    "silu_mul": silu_mul,
    "gelu": gelu,
    "copy_blocks": copy_blocks,
    "linear": linear,
    "rms_norm_linear": rms_norm_linear,
    "silu_mul_linear": silu_mul_linear,
    "warm_up_prefill_attention": sdpa_prefill.warm_up,
    # the weight-only matmuls: fused kernels for few rows, dequantize + cuBLAS for many (dequant_linear.py)
    "w4a16_linear": w4a16_linear,
    "w4_packed_linear": w4_packed_linear,
    "int8_linear": int8_linear,
    "fp8_linear": fp8_linear,  # per-token quantization here, the matmul cuBLASLt's through torch
    "rms_norm_fp8_linear": rms_norm_fp8_linear,  # the same, the norm or SiLU*mul quantizing what it writes
    "silu_mul_fp8_linear": silu_mul_fp8_linear,
}


def register_all() -> None:
    for name, fn in OPS.items():
        register(name, fn)


__all__ = [
    "OPS", "register_all", "write_kv", "paged_attention", "rms_norm", "layer_norm", "rotary_embedding",
    "rotary_write_kv", "rotary_attention", "silu_mul", "gelu", "copy_blocks", "sample_from_logits", "filter_logits", "linear",
    "rms_norm_linear", "silu_mul_linear", "w4a16_linear", "w4_packed_linear", "int8_linear", "fp8_linear",
    "rms_norm_fp8_linear", "silu_mul_fp8_linear",
]
