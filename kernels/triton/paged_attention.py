"""The registered ``paged_attention``: decode kernel (split-K) for pure decode steps, torch's SDPA for steps
of whole fp16/bf16 prompts (kernels/sdpa_prefill.py), else the prefill kernel."""

import torch

from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.kernels.sdpa_prefill import prompt_spans, sdpa_prefill
from kvrelay.kernels.triton.decode_attention import decode_attention
from kvrelay.kernels.triton.prefill_attention import prefill_attention


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
) -> torch.Tensor:
    # q: [T, H, D]; kv_cache: [2, N, bs, Hkv, D]; same contract as kernels.reference.paged_attention.
    # k, v: this step's keys/values (already in the cache); the prefill kernel reads them contiguously
    if meta.decode_only:
        return decode_attention(q, kv_cache, meta, scale, alibi_slopes)
    if k is not None and v is not None and alibi_slopes is None and q.dtype in (torch.float16, torch.bfloat16):
        spans = prompt_spans(meta)
        if spans is not None:
            return sdpa_prefill(q, k, v, spans, scale)
    # mixed batches (chunked prefill + decodes) take the prefill kernel: a decode row is a 1-token tile
    return prefill_attention(q, kv_cache, meta, scale, alibi_slopes, k, v)
