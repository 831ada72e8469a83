"""The registered ``paged_attention``: decode kernel (split-K) for pure decode steps, torch's SDPA for steps
of whole fp16/bf16 prompts (kernels/sdpa_prefill.py), else the prefill kernel; and ``rotary_attention``,
the same with rotary and the KV write in front. With an fp8 cache the kernels read it directly; SDPA,
which takes the step's own k/v, gets them rounded through fp8 as the cache holds them."""

import torch

from kvrelay.kernels import kv_quant
from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.kernels.sdpa_prefill import prompt_spans, sdpa_prefill
from kvrelay.kernels.triton.decode_attention import decode_attention, rotary_decode_attention
from kvrelay.kernels.triton.prefill_attention import prefill_attention
from kvrelay.kernels.triton.rotary import rotary_write_kv


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    # q: [T, H, D]; kv_cache: [2, N, bs, Hkv, D]; same contract as kernels.reference.paged_attention.
    # k, v: this step's keys/values (already in the cache); the prefill kernel reads them contiguously
    if meta.decode_only:
        return decode_attention(q, kv_cache, meta, scale, alibi_slopes, kv_scale=kv_scale)
    if k is not None and v is not None and alibi_slopes is None and q.dtype in (torch.float16, torch.bfloat16):
        spans = prompt_spans(meta)
        if spans is not None:
            k, v = kv_quant.as_cached(k, v, kv_cache, kv_scale)
            return sdpa_prefill(q, k, v, spans, scale)
    # mixed batches (chunked prefill + decodes) take the prefill kernel: a decode row is a 1-token tile
    return prefill_attention(q, kv_cache, meta, scale, alibi_slopes, k, v, kv_scale=kv_scale)


def rotary_attention(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    # the registered ``rotary_attention``: a decode step rotates, stores and attends in one kernel; other
    # steps rotate and store in one and attend in the next (the prefill kernels read the rotated k and v)
    if meta.decode_only:
        return rotary_decode_attention(positions, q, k, v, cos_sin_cache, kv_cache, meta, scale, kv_scale=kv_scale)
    q, k = rotary_write_kv(positions, q, k, v, cos_sin_cache, kv_cache, meta.slot_mapping, kv_scale)
    return paged_attention(q, kv_cache, meta, scale, k=k, v=v, kv_scale=kv_scale)
