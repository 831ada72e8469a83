"""Prefill attention through torch's fused SDPA (cuDNN on Hopper) for steps made only of whole long prompts.

A prompt with no cached prefix attends only to its own keys, which the model already holds contiguous
(the step's k/v beside the cache), so it needs no block table. There torch's cuDNN attention ran at 1.35x
our Triton kernel on an H200 (2 x 4,096 tokens, Llama-3-8B heads; bench/prefill_probe.py), and torch's
flash kernel slower than ours. Steps with a cached prefix or a later chunk of a longer prompt, short
prompts, ALiBi and fp32 keep the Triton kernel.

cuDNN builds an execution plan per shape on first use (about 45 ms on the H200), which would land in
the TTFT of whichever request first brings a new shape. So prompts run padded to one of a few lengths
(8 per octave: at most 12.5% more keys, never attended by a real query since the padding comes last and
attention is causal), those of one padded length together, up to MAX_PER_CALL a call: one call costs
the host about 0.1 ms, which eight 1,024-token prompts called one by one spent eight times over while
the GPU idled (bench/attn_probe.py). ``warm_up`` builds the plan of every (count, length) a step's
token budget allows before a worker is ready. Prompts already of a padded length and adjacent in the
step are passed as views of the step's rows (no copy); the rest are copied into a zero-tailed buffer.
"""

import torch
import torch.nn.functional as F

from kvrelay.kernels.metadata import AttentionMetadata

MIN_LEN = 1024  # shorter prompts keep the Triton kernel
MAX_PER_CALL = 8  # prompts of one padded length per SDPA call (and per warmed plan)

Span = tuple[int, int]  # (first row in the step, length) of one prompt


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


def prompt_spans(meta: AttentionMetadata) -> list[Span] | None:
    """(first row, length) of each prompt when the step is made only of whole prompts of at least MIN_LEN
    tokens; None otherwise."""
    starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    if not lens:
        return None
    for i, seq_len in enumerate(lens):
        if starts[i + 1] - starts[i] != seq_len or seq_len < MIN_LEN:
            return None  # a cached prefix or a later chunk (its keys are partly in the paged cache), or short
    return [(starts[i], n) for i, n in enumerate(lens)]


def calls(spans: list[Span]) -> list[tuple[int, list[Span]]]:
    """The SDPA calls a step makes: (padded length, its prompts), prompts of one padded length together,
    at most MAX_PER_CALL a call, in step order."""
    by_length: dict[int, list[Span]] = {}
    for span in spans:
        by_length.setdefault(bucket(span[1]), []).append(span)
    return [(padded, group[i:i + MAX_PER_CALL]) for padded, group in by_length.items()
            for i in range(0, len(group), MAX_PER_CALL)]


def _adjacent_and_exact(group: list[Span], padded: int) -> bool:
    return all(length == padded and row == group[0][0] + i * padded for i, (row, length) in enumerate(group))


def _stacked(t: torch.Tensor, group: list[Span], padded: int, exact: bool) -> torch.Tensor:
    """[T, h, D] -> the group's prompts as a contiguous [n, padded, h, D]: a view of the step's rows when
    they already are that (a strided v gets one copy), else a copy whose tails are zeros (padding keys
    must be finite: a NaN would reach real queries through the softmax's sum)."""
    if exact:
        row = group[0][0]
        return t[row:row + len(group) * padded].reshape(len(group), padded, *t.shape[1:]).contiguous()
    out = t.new_zeros((len(group), padded, *t.shape[1:]))
    for i, (row, length) in enumerate(group):
        out[i, :length] = t[row:row + length]
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # q: [n, Lp, H, D], k, v: [n, Lp, Hkv, D], contiguous: one layout for every call, so each call matches
    # a plan warm_up built for its (n, Lp) -> [n, Lp, H, D]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         scale=scale, enable_gqa=k.shape[2] != q.shape[2])  # [n, H, Lp, D]
    return out.transpose(1, 2)


def sdpa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[Span],
                 scale: float) -> torch.Tensor:
    # q: [T, H, D]; k, v: [T, Hkv, D] (this step's, any token stride) -> [T, H, D]
    plan = calls(spans)
    out = None
    for padded, group in plan:
        exact = _adjacent_and_exact(group, padded)
        result = _attend(*(_stacked(t, group, padded, exact) for t in (q, k, v)), scale)  # [n, Lp, H, D]
        if exact and len(plan) == 1 and len(group) * padded == q.shape[0]:
            return result.reshape(q.shape)  # the whole step in one call: its rows are the output's
        if out is None:
            out = torch.empty_like(q)
        for i, (row, length) in enumerate(group):
            out[row:row + length] = result[i, :length]
    return out


def plan_shapes(max_len: int, max_tokens: int) -> list[tuple[int, int]]:
    """Every (prompts, padded length) a call can have when one prompt is at most ``max_len`` tokens and a
    step at most ``max_tokens``."""
    sizes = buckets(max_len)
    shortest = ([MIN_LEN] + [padded + 1 for padded in sizes])[:len(sizes)]  # the shortest prompt of each
    return [(n, padded) for padded, low in zip(sizes, shortest, strict=True)
            for n in range(1, max(1, min(MAX_PER_CALL, max_tokens // low)) + 1)]


def warm_up(q_like: torch.Tensor, num_kv_heads: int, max_len: int, max_tokens: int) -> int:
    """Run every call shape for heads and dtype like ``q_like`` ([*, H, D]) once; returns how many (0 for fp32,
    which never takes this path). A worker calls it during warm-up (shared/engine/warmup.py)."""
    if q_like.dtype not in (torch.float16, torch.bfloat16):
        return 0
    heads, dim = q_like.shape[-2], q_like.shape[-1]
    shapes = plan_shapes(max_len, max_tokens)
    for n, padded in shapes:
        q = q_like.new_zeros((n, padded, heads, dim))
        k = q_like.new_zeros((n, padded, num_kv_heads, dim))
        _attend(q, k, k, dim ** -0.5)
    return len(shapes)
