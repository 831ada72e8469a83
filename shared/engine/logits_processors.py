"""The logits processors the sampler runs before it draws (steps 1-5 of sampler.py's docstring), each a
batched function over [S, V] logits with per-row parameters: min_tokens, logit_bias, allowed_token_ids,
repetition / frequency / presence penalties, and the temperature-scaled top-k / top-p / min-p filter.
Structured outputs' bitmask is applied beside them (shared/engine/structured/bitmask.py).
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from kvrelay.shared.wire.sampling_params import SamplingParams


def to_device(data: list | Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Host list -> device tensor without stalling the host on the device's queue (pinned + async)."""
    cpu = data.to(dtype) if isinstance(data, Tensor) else torch.tensor(data, dtype=dtype)
    if device.type == "cpu":
        return cpu
    return cpu.pin_memory().to(device, non_blocking=True)


def _padded(rows: Sequence[Sequence[int]], pad: int) -> list[list[int]]:
    """Rectangular copy of ragged token lists; ``pad`` marks unused slots (at least one column)."""
    width = max(1, max((len(r) for r in rows), default=0))
    return [list(r) + [pad] * (width - len(r)) for r in rows]


def apply_min_tokens(logits: Tensor, banned: Sequence[Sequence[int]]) -> Tensor:
    """Set ``logits[i, t] = -inf`` for every ``t`` in ``banned[i]`` (out-of-range ids are ignored).

    logits: [S, V]; returns a new tensor. The caller fills ``banned[i]`` with eos + stop ids only for
    rows still below their ``min_tokens``.
    """
    num_rows, vocab = logits.shape
    # Column V is a sink for padding and for ids outside the vocabulary, dropped after the scatter.
    cleaned = [[t if 0 <= t < vocab else vocab for t in row] for row in banned]
    index = to_device(_padded(cleaned, vocab), torch.int64, logits.device)  # [S, L]
    mask = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
    mask.scatter_(1, index, True)
    return logits.masked_fill(mask[:, :vocab], float("-inf"))


def logit_bias_tensors(bias: dict[int, float]) -> tuple[Tensor, Tensor]:
    """One request's {token id: bias} as host tensors (ids int64, biases float32): built once per request,
    since ``torch.tensor`` of a Python list costs about a microsecond an element."""
    return torch.tensor(list(bias), dtype=torch.int64), torch.tensor(list(bias.values()), dtype=torch.float32)


def apply_logit_bias(logits: Tensor, biases: Sequence[tuple[Tensor, Tensor] | None]) -> Tensor:
    """Add each row's biases to its logits; returns a new tensor. logits: [S, V]; ``biases[i]`` is row i's
    ``logit_bias_tensors`` or None.

    The batch's entries become one flat index (``row * V + id``) and one value tensor on the host, then a
    single ``index_add`` on the device. Ids outside the vocabulary are dropped: the engine core refuses
    them, this only keeps a bad id from crashing a step or landing in another row.
    """
    num_rows, vocab = logits.shape
    rows = [i for i, b in enumerate(biases) if b is not None]
    if not rows:
        return logits
    token = torch.cat([biases[i][0] for i in rows])  # [N]
    values = torch.cat([biases[i][1] for i in rows])  # [N]
    counts = torch.tensor([biases[i][0].numel() for i in rows])
    row = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), counts)  # [N]
    keep = (token >= 0) & (token < vocab)
    flat = to_device((row * vocab + token)[keep], torch.int64, logits.device)  # [N']
    added = to_device(values[keep], logits.dtype, logits.device)
    return logits.reshape(-1).index_add(0, flat, added).view(num_rows, vocab)


def apply_allowed_tokens(logits: Tensor, allowed: Sequence[Tensor | None]) -> Tensor:
    """-inf for every token outside row i's ``allowed[i]`` (int64 ids on the host; None: every token).
    Returns a new tensor; ids outside the vocabulary are dropped (the engine core refuses them)."""
    num_rows, vocab = logits.shape
    rows = [i for i, a in enumerate(allowed) if a is not None]
    if not rows:
        return logits
    token = torch.cat([allowed[i] for i in rows])  # [N]
    counts = torch.tensor([allowed[i].numel() for i in rows])
    row = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), counts)  # [N]
    keep = (token >= 0) & (token < vocab)
    flat = to_device((row * vocab + token)[keep], torch.int64, logits.device)  # [N']
    restricted = torch.zeros(num_rows, dtype=torch.bool)
    restricted[rows] = True
    # [S, V]: True where a restricted row may not sample
    banned = to_device(restricted, torch.bool, logits.device).unsqueeze(1).expand(num_rows, vocab).contiguous()
    banned.view(-1)[flat] = False
    return logits.masked_fill(banned, float("-inf"))


def apply_penalties(
    logits: Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalty: Tensor,
    frequency_penalty: Tensor,
    presence_penalty: Tensor,
    pending: Tensor | None = None,
) -> Tensor:
    """Repetition (HF) then frequency/presence (OpenAI) penalties; returns a new tensor.

    logits: [S, V]; penalties: [S] float on the logits' device (1.0 / 0.0 / 0.0 leave a row unchanged).
    Repetition: every token seen in prompt or output has a positive logit divided by the penalty and a
    negative one multiplied by it. Frequency/presence: ``logit -= freq * count + presence * (count > 0)``
    with counts over the output tokens only. ``pending``: [S] int64 on the device, one more output token
    per row that the host has not read yet (async scheduling), -1 for none.
    """
    num_rows, vocab = logits.shape
    device = logits.device
    # Column V absorbs padding so ragged rows scatter in one call; it is sliced off afterwards.
    out_index = to_device(_padded(output_token_ids, vocab), torch.int64, device)  # [S, Lo]
    if pending is not None:  # -1 (none) goes to the padding column
        out_index = torch.cat((out_index, pending.where(pending >= 0, vocab).unsqueeze(1)), dim=1)  # [S, Lo + 1]
    counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=device)
    counts.scatter_add_(1, out_index, torch.ones_like(out_index, dtype=logits.dtype))
    counts = counts[:, :vocab]  # [S, V] occurrences in the output

    prompt_index = to_device(_padded(prompt_token_ids, vocab), torch.int64, device)  # [S, Lp]
    seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=device)
    seen.scatter_(1, prompt_index, True)
    seen = seen[:, :vocab] | (counts > 0)  # [S, V] in prompt or output

    rep = repetition_penalty.to(logits.dtype).unsqueeze(1)  # [S, 1]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    freq = frequency_penalty.to(logits.dtype).unsqueeze(1)  # [S, 1]
    presence = presence_penalty.to(logits.dtype).unsqueeze(1)  # [S, 1]
    return logits - freq * counts - presence * (counts > 0).to(logits.dtype)


def penalized(params: SamplingParams) -> bool:
    """Whether a request's logits depend on its earlier output tokens (repetition/frequency/presence)."""
    return params.repetition_penalty != 1.0 or bool(params.frequency_penalty) or bool(params.presence_penalty)


def apply_top_k_top_p_min_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None, min_p: Tensor | None) -> Tensor:
    """Mask (to ``-inf``) tokens outside top-k, then outside top-p, then below min-p; returns a new tensor.

    logits: [S, V] (already temperature-scaled); top_k: [S] int (<= 0 or >= V: off); top_p: [S] float
    (>= 1: off); min_p: [S] float (<= 0: off). ``None`` switches a filter off for every row.
    Semantics, per row:
      top-k keeps every token whose logit is >= the k-th largest (ties at the boundary are all kept);
      top-p keeps the smallest highest-probability set whose mass (renormalised after top-k) reaches p,
        again keeping every token tied with the least probable member;
      min-p keeps tokens whose probability is >= min_p * the largest probability.
    The most likely token always survives, so every row keeps at least one token.
    """
    vocab = logits.shape[1]
    if top_k is not None or top_p is not None:
        # One ascending sort serves both filters: each removes a prefix of the sorted row, so the
        # union is a prefix too and becomes a single per-row threshold on the original logits.
        sorted_logits, _ = logits.sort(dim=-1)  # [S, V] ascending
        removed = torch.zeros_like(sorted_logits, dtype=torch.bool)  # [S, V]
        if top_k is not None:
            k = top_k.to(device=logits.device, dtype=torch.int64)
            k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)  # [S]
            kth_largest = sorted_logits.gather(1, (vocab - k).unsqueeze(1))  # [S, 1]
            removed |= sorted_logits < kth_largest
        if top_p is not None:
            p = top_p.to(device=logits.device, dtype=logits.dtype).unsqueeze(1)  # [S, 1]
            probs = sorted_logits.masked_fill(removed, float("-inf")).softmax(dim=-1)  # [S, V]
            # Ascending cumulative mass: a token goes when everything at or below it sums to <= 1 - p,
            # i.e. the tokens above it already reach p.
            cumulative = probs.cumsum(dim=-1)  # [S, V]
            removed |= (cumulative <= 1 - p) & (p < 1)
        removed[:, -1] = False  # rounding in the cumsum must never remove the top token
        first_kept = removed.sum(dim=-1, keepdim=True)  # [S, 1] length of the removed prefix
        threshold = sorted_logits.gather(1, first_kept)  # [S, 1] smallest kept logit
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if min_p is not None:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); log(0) = -inf keeps everything.
        mp = min_p.to(device=logits.device, dtype=logits.dtype).clamp(min=0).unsqueeze(1)  # [S, 1]
        max_logit = logits.max(dim=-1, keepdim=True).values  # [S, 1]
        logits = logits.masked_fill(logits < max_logit + mp.log(), float("-inf"))
    return logits
