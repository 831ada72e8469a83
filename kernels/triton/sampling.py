"""GPU sampling without host syncs: temperature, top-k / top-p / min-p filtering, exponential race.

Semantics are those of ``shared/engine/logits_processors.apply_top_k_top_p_min_p`` and its ``Sampler`` (vLLM's order):
greedy rows (temperature 0) take the argmax of the given logits; the other rows are divided by their
temperature, then filtered, each filter keeping every token tied with its boundary token:
  top-k (``k <= 0`` or ``k > V`` is off) keeps logits >= the k-th largest;
  top-p (``p >= 1`` is off) keeps the smallest most-probable set, renormalised after top-k, whose mass
  reaches p;
  min-p (``<= 0`` is off) keeps tokens with probability >= min_p * the largest.
One draw per row is ``argmax(probs / q)`` with ``q ~ Exp(1)``, an exact sample that needs no cumsum
search and no sync. Everything stays on the logits' device; the caller reads the ids when it wants.

Sort-free where the batch allows it: min-p and temperature never sort; top-k sorts nothing when the
caller passes ``top_k_bound`` (a host-side int it knows from the sampling params, no device read), using
one ``topk(bound)``; only top-p needs the full row sort. Pass ``None`` for a filter no row uses.
"""

import torch
from torch import Tensor


def _kth_largest_threshold(logits: Tensor, k: Tensor, bound: int | None) -> Tensor:
    # logits: [S, V]; k: [S] int64 already mapped to V where top-k is off -> [S, 1] threshold
    vocab = logits.shape[1]
    if bound is not None and bound < vocab:
        top = logits.topk(max(1, bound), dim=-1).values  # [S, bound], descending
        kth = top.gather(1, (k.clamp(max=top.shape[1]) - 1).unsqueeze(1))
        return torch.where((k >= vocab).unsqueeze(1), torch.full_like(kth, float("-inf")), kth)
    ascending = logits.sort(dim=-1).values
    return ascending.gather(1, (vocab - k).unsqueeze(1))


def filter_logits(
    logits: Tensor,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    min_p: Tensor | None = None,
    top_k_bound: int | None = None,
) -> Tensor:
    """Mask filtered tokens to -inf; logits [S, V] already temperature-scaled. Returns a new tensor."""
    vocab = logits.shape[1]
    out = logits
    if top_p is not None:
        # one ascending sort serves both filters; their union is a prefix of the sorted row, i.e. a
        # single per-row threshold on the original logits
        ascending = logits.sort(dim=-1).values  # [S, V]
        removed = torch.zeros_like(ascending, dtype=torch.bool)
        if top_k is not None:
            k = top_k.to(device=logits.device, dtype=torch.int64)
            k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
            removed |= ascending < ascending.gather(1, (vocab - k).unsqueeze(1))
        p = top_p.to(device=logits.device, dtype=logits.dtype).unsqueeze(1)  # [S, 1]
        cumulative = ascending.masked_fill(removed, float("-inf")).softmax(dim=-1).cumsum(dim=-1)
        removed |= (cumulative <= 1 - p) & (p < 1)
        removed[:, -1] = False  # cumsum rounding must never drop the most likely token
        threshold = ascending.gather(1, removed.sum(dim=-1, keepdim=True))  # smallest kept logit
        out = out.masked_fill(out < threshold, float("-inf"))
    elif top_k is not None:
        k = top_k.to(device=logits.device, dtype=torch.int64)
        k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
        out = out.masked_fill(out < _kth_largest_threshold(logits, k, top_k_bound), float("-inf"))
    if min_p is not None:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); log(0) = -inf keeps all
        mp = min_p.to(device=logits.device, dtype=logits.dtype).clamp(min=0).unsqueeze(1)
        out = out.masked_fill(out < out.max(dim=-1, keepdim=True).values + mp.log(), float("-inf"))
    return out


def sample_from_logits(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    min_p: Tensor | None = None,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
    top_k_bound: int | None = None,
) -> Tensor:
    """logits [S, V] fp32, temperature/top_k/top_p/min_p [S] -> token ids [S] int64, on the device.

    ``noise`` [S, V] holds Exp(1) draws (per-row seeded streams are the caller's); without it one
    batch of draws comes from ``generator``. ``top_k_bound``: host int >= every enabled row's k.
    """
    logits = logits.float()
    greedy_ids = logits.argmax(dim=-1)  # [S]
    temp = temperature.to(device=logits.device, dtype=torch.float32)
    is_greedy = temp <= 0
    # greedy rows divide by 1 so they stay finite; their draw is discarded below
    scaled = logits / torch.where(is_greedy, torch.ones_like(temp), temp).unsqueeze(1)
    probs = filter_logits(scaled, top_k, top_p, min_p, top_k_bound).softmax(dim=-1)  # [S, V]
    if noise is None:
        noise = torch.empty_like(probs).exponential_(generator=generator)
    # exponential_ can return exactly 0 on some backends; 0/0 would be NaN and win the argmax
    noise = noise.clamp(min=torch.finfo(torch.float32).tiny)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(is_greedy, greedy_ids, sampled)
