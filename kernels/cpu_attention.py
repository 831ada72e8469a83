"""Paged attention for the CPU engine: reference.paged_attention's semantics, built for speed.

The reference is written to be read (and to check the Triton kernels against); on CPU it is also what
the engine ran, and a decode step spent about a fifth of its time there: every layer gathered every
sequence's whole blocks, then two einsums copied K and V again into batched-matmul layout. Here:

- decode: each layer copies every sequence's blocks up to max_seq_len with one index_select each for
  K and V, and torch's fused SDPA reads them in place (GQA without repeating heads, a boolean length
  mask);
- prefill with no cached prefix (``q_len == seq_len``): the step's own contiguous k/v, causal SDPA,
  nothing read back through the block table.
ALiBi and chunks that extend a cached prefix take the reference (kept exact, rarely hot on CPU).
An fp8 cache (kernels/kv_quant.py) is dequantized as it is read; a prefill's own k/v are rounded through
fp8 first, so they are the values a later read of the cache gives.
"""

import torch
import torch.nn.functional as F

from kvrelay.kernels import kv_quant, reference
from kvrelay.kernels.metadata import AttentionMetadata


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
    # q: [T, H, D] -> [T, H, D]; k, v: this step's [T, Hkv, D], already written to kv_cache
    if alibi_slopes is not None:
        return reference.paged_attention(q, kv_cache, meta, scale, alibi_slopes, kv_scale=kv_scale)
    if meta.decode_only:
        return _decode(q, kv_cache, meta, scale, kv_scale)
    if k is not None and v is not None:
        k, v = kv_quant.as_cached(k, v, kv_cache, kv_scale)
    return _prefill(q, kv_cache, meta, scale, k, v, kv_scale)


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
            kv_scale: torch.Tensor | None) -> torch.Tensor:
    num_seqs, _, head_dim = q.shape
    blocks, mask = _decode_index(meta, kv_cache.shape[2])
    # whole blocks, not single positions: index_select copies each block's [bs, Hkv, D] in one run,
    # where a per-position gather from the block-major pool was slower than the reference's
    shape = (num_seqs, -1, kv_cache.shape[3], head_dim)
    keys = kv_cache[0].index_select(0, blocks).view(shape).transpose(1, 2)  # [S, Hkv, L, D]
    values = kv_cache[1].index_select(0, blocks).view(shape).transpose(1, 2)
    keys, values = kv_quant.dequantize_kv(keys, values, kv_scale, q.dtype)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask,
                                         scale=scale, enable_gqa=True)  # [S, H, 1, D]
    return out.squeeze(2)


def _decode_index(meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks to read ([S * nb], each sequence's first nb blocks, nb enough for max_seq_len) and
    the mask [S, 1, 1, nb * block_size] of the positions each sequence has. Recomputed by every layer
    (a few small ops): decode-graph metadata is refilled in place between steps, so nothing derived
    from it may outlive one call."""
    num_blocks = -(-meta.max_seq_len // block_size)
    blocks = meta.block_tables[:, :num_blocks].reshape(-1)
    pos = torch.arange(num_blocks * block_size, device=blocks.device)
    mask = (pos[None, :] < meta.seq_lens.long()[:, None])[:, None, None, :]
    return blocks, mask


def _prefill(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
             k: torch.Tensor | None, v: torch.Tensor | None, kv_scale: torch.Tensor | None) -> torch.Tensor:
    if k is None or v is None:
        return reference.paged_attention(q, kv_cache, meta, scale, kv_scale=kv_scale)
    out = torch.empty_like(q)
    qsl = meta.query_start_loc_cpu
    for i in range(meta.num_seqs):
        start, end = qsl[i], qsl[i + 1]
        if end - start != meta.seq_lens_cpu[i]:  # extends a cached prefix: read it through the table
            out[start:end] = _one_sequence(q, kv_cache, meta, scale, i, kv_scale)
            continue
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k[start:end].transpose(0, 1).to(q.dtype),
            v[start:end].transpose(0, 1).to(q.dtype), is_causal=True, scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
    return out


def _one_sequence(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                  i: int, kv_scale: torch.Tensor | None) -> torch.Tensor:
    start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
    one = AttentionMetadata(
        slot_mapping=meta.slot_mapping[start:end], query_start_loc=meta.query_start_loc.new_tensor([0, end - start]),
        seq_lens=meta.seq_lens[i:i + 1], block_tables=meta.block_tables[i:i + 1],
        query_start_loc_cpu=[0, end - start], seq_lens_cpu=[meta.seq_lens_cpu[i]],
        max_query_len=end - start, max_seq_len=meta.seq_lens_cpu[i])
    return reference.paged_attention(q[start:end], kv_cache, one, scale, kv_scale=kv_scale)
