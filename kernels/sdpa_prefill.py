"""Prefill attention through torch's fused SDPA (cuDNN on Hopper) for steps made only of whole long prompts.

A prompt with no cached prefix attends only to its own keys, which the model already holds contiguous
(the step's k/v beside the cache), so it needs no block table. There torch's cuDNN attention ran at 1.35x
our Triton kernel on an H200 (2 x 4,096 tokens, Llama-3-8B heads; bench/prefill_probe.py), and torch's
flash kernel slower than ours. Steps with a cached prefix or a later chunk of a longer prompt, short
prompts (one Triton launch for many beats a launch each), ALiBi and fp32 keep the Triton kernel.

cuDNN builds an execution plan per shape on first use (about 45 ms on the H200), which would land in
the TTFT of whichever request first brings a new prompt length. So each prompt runs alone, padded to
one of a few lengths (8 per octave: at most 12.5% more keys, never attended by a real query since the
padding comes last and attention is causal), and ``warm_up`` builds those plans before a worker is ready.
"""

import torch
import torch.nn.functional as F

from kvrelay.kernels.metadata import AttentionMetadata

MIN_LEN = 1024  # shorter prompts keep the Triton kernel
MAX_CALLS = 8  # prompts per step; more keep one Triton launch


def bucket(length: int) -> int:
    """The padded length a prompt of ``length`` tokens runs at: 8 lengths per octave."""
    step = max(1, 1 << (length.bit_length() - 4))
    return -(-length // step) * step


def buckets(max_len: int) -> list[int]:
    """Every padded length a prompt of MIN_LEN .. max_len tokens can run at."""
    out, length = [], MIN_LEN
    while length <= max_len:
        out.append(bucket(length))
        length = out[-1] + 1
    return out


def prompt_spans(meta: AttentionMetadata) -> list[tuple[int, int]] | None:
    """(first row, length) of each prompt when the step is made only of whole prompts of at least MIN_LEN
    tokens, at most MAX_CALLS of them; None otherwise."""
    starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    if not 0 < len(lens) <= MAX_CALLS:
        return None
    for i, seq_len in enumerate(lens):
        if starts[i + 1] - starts[i] != seq_len or seq_len < MIN_LEN:
            return None  # a cached prefix or a later chunk (its keys are partly in the paged cache), or short
    return [(starts[i], n) for i, n in enumerate(lens)]


def _padded(t: torch.Tensor, padded: int) -> torch.Tensor:
    """[L, h, D] as a contiguous [1, padded, h, D]: a view when it already is one, else a copy whose tail
    is zeros (padding keys must be finite: a NaN would reach real queries through the softmax's sum)."""
    length = t.shape[0]
    if length == padded and t.is_contiguous():
        return t.unsqueeze(0)
    out = t.new_empty((1, padded, t.shape[1], t.shape[2]))
    out[0, :length] = t
    out[0, length:] = 0
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # q: [L, H, D], k, v: [L, Hkv, D] -> [L, H, D], as contiguous [1, Lp, h, D] tensors padded to the bucket:
    # one layout and one length per bucket, so every call matches a plan warm_up built
    length, padded = q.shape[0], bucket(q.shape[0])
    qp, kp, vp = (_padded(t, padded).transpose(1, 2) for t in (q, k, v))  # [1, h, Lp, D]
    out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                         enable_gqa=kp.shape[1] != qp.shape[1])  # [1, H, Lp, D]
    return out[0, :, :length].transpose(0, 1)


def sdpa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[tuple[int, int]],
                 scale: float) -> torch.Tensor:
    # q: [T, H, D]; k, v: [T, Hkv, D] (this step's, contiguous per token) -> [T, H, D]
    if len(spans) == 1:
        return _attend(q, k, v, scale)
    out = torch.empty_like(q)
    for row, length in spans:
        rows = slice(row, row + length)
        out[rows] = _attend(q[rows], k[rows], v[rows], scale)
    return out


def warm_up(q_like: torch.Tensor, num_kv_heads: int, max_len: int) -> int:
    """Run every bucket up to ``max_len`` once for heads and dtype like ``q_like`` ([*, H, D]); returns how
    many (0 for fp32, which never takes this path). A worker calls it during warm-up (shared/engine/warmup.py)."""
    if q_like.dtype not in (torch.float16, torch.bfloat16):
        return 0
    heads, dim = q_like.shape[-2], q_like.shape[-1]
    sizes = buckets(max_len)
    for length in sizes:
        q = q_like.new_zeros((length, heads, dim))
        k = q_like.new_zeros((length, num_kv_heads, dim))
        _attend(q, k, k, dim ** -0.5)
    return len(sizes)
