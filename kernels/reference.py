"""Plain-torch reference implementations of every kernel.

The CPU path runs these; the Triton kernels are tested against them. Cache layout for one layer:
``kv_cache[0]`` keys and ``kv_cache[1]`` values, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
"""

import torch
import torch.nn.functional as F

from kvrelay.kernels import kv_quant
from kvrelay.kernels.metadata import AttentionMetadata

# the quantized matmuls' references live with their weight layouts
from kvrelay.kernels.quant import fp8_linear, int8_linear, w4a16_linear  # noqa: F401
from kvrelay.kernels.w4_repack import w4_packed_linear  # noqa: F401


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scale: torch.Tensor | None = None) -> None:
    # k, v: [T, Hkv, D]; slot_mapping: [T], -1 marks a token whose KV is not stored (padding). An fp8
    # cache stores k / K scale and v / V scale (kernels/kv_quant.py; kv_scale None: scale 1)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    # (block, offset) indexing, not a flat [N*bs] view: a pooled cache is block-major, so one layer's
    # blocks are strided apart (shared/engine/kv_pool.py)
    block, offset = slots // kv_cache.shape[2], slots % kv_cache.shape[2]
    if kv_quant.is_fp8(kv_cache):
        one = torch.ones((), dtype=torch.float32, device=k.device)
        k_scale, v_scale = kv_scale if kv_scale is not None else (one, one)
        kv_cache[0, block, offset] = kv_quant.quantize(k[keep], k_scale)
        kv_cache[1, block, offset] = kv_quant.quantize(v[keep], v_scale)
        return
    kv_cache[0, block, offset] = k[keep].to(kv_cache.dtype)
    kv_cache[1, block, offset] = v[keep].to(kv_cache.dtype)


def _gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int, dtype: torch.dtype,
               kv_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    # a sequence's first ``length`` keys and values as ``dtype`` (an fp8 cache's dequantized)
    block_size = kv_cache.shape[2]
    n_blocks = (length + block_size - 1) // block_size
    blocks = kv_cache[:, block_table[:n_blocks].long()]  # [2, n, bs, Hkv, D]
    kv = blocks.flatten(1, 2)[:, :length]  # [2, length, Hkv, D]
    return kv_quant.dequantize_kv(kv[0], kv[1], kv_scale, dtype)


def _alibi_bias(slopes: torch.Tensor, key_len: int, dtype: torch.dtype) -> torch.Tensor:
    # softmax is shift-invariant per row, so slope * key_position equals slope * (key - query) causally
    pos = torch.arange(key_len, device=slopes.device, dtype=torch.float32)
    return (slopes.float()[:, None] * pos[None, :]).to(dtype)  # [H, key_len]


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
    # q: [T, H, D] -> out [T, H, D]; causal over each sequence's cached prefix plus its new tokens.
    # k, v (this step's keys/values, already in the cache) are accepted and unused: the cache is read.
    # kv_scale: [2] float32 (K, V) of an fp8 cache (kernels/kv_quant.py; None: scale 1)
    if meta.decode_only:
        return _decode_attention(q, kv_cache, meta, scale, alibi_slopes, kv_scale)
    out = torch.empty_like(q)
    num_heads = q.shape[1]
    for i in range(meta.num_seqs):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        seq_len = meta.seq_lens_cpu[i]
        q_len = end - start
        k, v = _gather_kv(kv_cache, meta.block_tables[i], seq_len, q.dtype, kv_scale)  # [L, Hkv, D]
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qi = q[start:end].transpose(0, 1)  # [H, q_len, D]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        allowed = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, L]
        mask = torch.zeros(q_len, seq_len, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
        if alibi_slopes is not None:
            mask = mask[None] + _alibi_bias(alibi_slopes, seq_len, q.dtype)[:, None, :]
        o = F.scaled_dot_product_attention(qi, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


def _decode_attention(q, kv_cache, meta, scale, alibi_slopes, kv_scale=None):
    # one query per sequence: gather every sequence's blocks at once and mask past its length
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    max_blocks = (meta.max_seq_len + block_size - 1) // block_size
    tables = meta.block_tables[:, :max_blocks].long()
    kv = kv_cache[:, tables].flatten(2, 3)  # [2, S, L, Hkv, D]
    k, v = kv_quant.dequantize_kv(kv[0], kv[1], kv_scale, q.dtype)
    group = num_heads // num_kv_heads
    qg = q.view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("skgd,slkd->skgl", qg.float(), k.float()) * scale  # [S, Hkv, G, L]
    if alibi_slopes is not None:
        bias = _alibi_bias(alibi_slopes, k.shape[1], torch.float32).view(num_kv_heads, group, -1)
        scores = scores + bias[None]
    positions = torch.arange(k.shape[1], device=q.device)
    valid = positions[None, :] < meta.seq_lens.to(q.device)[:, None].long()  # [S, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.einsum("skgl,slkd->skgd", probs, v.float())
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    # with a residual: x += residual first and return (normed, new residual), as fused kernels do
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return out if residual is None else (out, residual)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), None if bias is None else bias.float(), eps).to(x.dtype)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # NeoX/Llama layout: rotate the two halves of the first rot_dim channels.
    # q: [T, H, D], k: [T, Hkv, D], cos_sin_cache: [max_pos, rot_dim] = cat(cos, sin)
    cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)  # [T, rot_dim/2]
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        rot_dim = cos.shape[-1] * 2
        xr, rest = x[..., :rot_dim].float(), x[..., rot_dim:]
        x1, x2 = xr.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated

    return rotate(q), rotate(k)


def rotary_write_kv(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # rotary_embedding then write_kv of the rotated k and v; returns the rotated (q, k)
    q, k = rotary_embedding(positions, q, k, cos_sin_cache)
    write_kv(k, v, kv_cache, slot_mapping, kv_scale)
    return q, k


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2I] (gate | up) -> [T, I]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    # linear(rms_norm(x [+ residual])) and the residual stream after the add (x itself without a residual)
    if residual is None:
        return F.linear(rms_norm(x, norm_weight, eps), weight, bias), x
    normed, residual = rms_norm(x, norm_weight, eps, residual)
    return F.linear(normed, weight, bias), residual


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [T, 2I] (gate | up) -> linear(silu(gate) * up): [T, N]
    return F.linear(silu_mul(x), weight, bias)


def rms_norm_fp8_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is None:
        return fp8_linear(rms_norm(x, norm_weight, eps), weight, scale, bias), x
    normed, residual = rms_norm(x, norm_weight, eps, residual)
    return fp8_linear(normed, weight, scale, bias), residual


def silu_mul_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    return fp8_linear(silu_mul(x), weight, scale, bias)


def warm_up_prefill_attention(q_like: torch.Tensor, num_kv_heads: int, max_len: int, max_tokens: int) -> int:
    return 0  # nothing here builds per-shape state on first use


def gelu(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    return F.gelu(x, approximate=approximate)


def copy_blocks(src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor,
                layers: range) -> None:
    # dst[layers][:, :, dst_ids] = src[layers][:, :, src_ids] between [L, 2, N, bs, Hkv, D] caches of any
    # layout (layer-major or a block-major pool view) and block counts. Each cache's memory as rows of one
    # (layer, K/V, block): a row gather then a row scatter, whole contiguous rows being what torch's index
    # kernels do best; the temporary holds every copied byte
    row = src[0, 0, 0].numel()
    planes = torch.arange(2 * layers.start, 2 * layers.stop, device=src_ids.device)
    src_rows, dst_rows = (kv.as_strided((kv.numel() // row, row), (row, 1)) for kv in (src, dst))
    if all(row * r.element_size() % 8 == 0 and r.storage_offset() * r.element_size() % 8 == 0
           for r in (src_rows, dst_rows)):  # index kernels cost per element: move 8-byte words
        src_rows, dst_rows = src_rows.view(torch.int64), dst_rows.view(torch.int64)
    elif kv_quant.is_fp8(src_rows):  # the bytes as they are: index kernels need not know fp8
        src_rows, dst_rows = src_rows.view(torch.uint8), dst_rows.view(torch.uint8)

    def row_ids(kv: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        start = (planes // 2) * kv.stride(0) + (planes % 2) * kv.stride(1)
        return ((start[:, None] + ids.long()[None, :] * kv.stride(2)) // row).reshape(-1)

    dst_rows.index_copy_(0, row_ids(dst, dst_ids), src_rows.index_select(0, row_ids(src, src_ids)))
