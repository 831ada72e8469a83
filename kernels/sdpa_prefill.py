"""Prefill attention through torch's fused SDPA (flash on Hopper) for steps made only of whole prompts.

A prompt with no cached prefix attends only to its own keys, which the model already holds contiguous
(the step's k/v beside the cache), so it needs no block table. There torch's flash kernel ran at 1.35x
our Triton kernel on an H200 (2 x 4,096 tokens, Llama-3-8B heads; bench/prefill_probe.py). Steps with
a cached prefix or a chunk of a longer prompt, ALiBi, or fp32 keep the Triton kernel, and so do steps
of many short prompts, where one Triton launch beats a launch per prompt.
"""

import torch
import torch.nn.functional as F

from kvrelay.kernels.metadata import AttentionMetadata

MAX_CALLS = 8  # runs of equal-length prompts, one SDPA call each
MIN_TOKENS = 1024  # per call, on average: below it the launches cost more than the faster kernel saves


def prompt_runs(meta: AttentionMetadata) -> list[tuple[int, int, int]] | None:
    """(first row, prompts, length) of each run of consecutive equal-length whole prompts, or None when
    the step is not made only of whole prompts (or would take too many calls)."""
    starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    runs: list[tuple[int, int, int]] = []
    for i, seq_len in enumerate(lens):
        if starts[i + 1] - starts[i] != seq_len:
            return None  # a cached prefix or a later chunk: its keys are partly in the paged cache
        if runs and runs[-1][2] == seq_len:
            row, count, _ = runs[-1]
            runs[-1] = (row, count + 1, seq_len)
        else:
            runs.append((starts[i], 1, seq_len))
    if not runs or len(runs) > MAX_CALLS or starts[-1] < MIN_TOKENS * len(runs):
        return None
    return runs


def sdpa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: list[tuple[int, int, int]],
                 scale: float) -> torch.Tensor:
    # q: [T, H, D]; k, v: [T, Hkv, D] (this step's, contiguous) -> [T, H, D]
    outs = []
    for row, count, length in runs:
        span = slice(row, row + count * length)
        qs, ks, vs = (t[span].view(count, length, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                             enable_gqa=ks.shape[1] != qs.shape[1])  # [count, H, L, D]
        outs.append(out.transpose(1, 2).reshape(count * length, q.shape[1], q.shape[2]))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
