"""Batched next-token sampling for the engine core: penalties, filtering, seeded draws, logprobs.

One call handles one decode/prefill step for ``S`` sequences. Processing order follows vLLM/HF:

1. min_tokens: eos and ``stop_token_ids`` get ``-inf`` while the output is shorter than ``min_tokens``;
2. logit_bias (OpenAI): each row's {token id: bias} added to its logits, one scatter-add for the batch
   (each request's bias becomes host tensors once, kept until ``free``); then allowed_token_ids (vLLM):
   every other token of the row gets ``-inf``; then structured outputs: a constrained row's tokens outside
   its grammar's bitmask get ``-inf`` (shared/engine/structured/bitmask.py; only those rows are touched);
3. repetition penalty (HF, over prompt + output tokens);
4. frequency and presence penalties (OpenAI, over output tokens only);
5. greedy rows take the argmax here; sampled rows continue with temperature, top-k, top-p, min-p
   and one draw through the exponential race ``argmax(probs / q)``, ``q ~ Exp(1)``.

Everything runs batched on the logits' device with per-row parameter tensors; the only per-row loop
draws noise for seeded rows, each from its own generator, so a seeded request's tokens do not depend on
which other requests share its batch or on its row position. Results reach the host in one transfer.
Returned logprobs are those of the raw model distribution (``log_softmax`` of the unmodified logits,
before min_tokens, logit_bias and penalties), as vLLM returns by default (``logprobs_mode=raw_logprobs``),
computed only in steps where some row asked for them.

Steps 1-4 run before greedy and sampled rows part ways, so the CPU path, the CUDA path and the all-greedy
argmax all see the same processed logits.

On CUDA, sampled rows go through ``kernels.triton.sampling.sample_from_logits`` (same filters, same
noise, a sort-free top-k), with every row's parameters in one host -> device copy.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvrelay.shared.engine.outputs import Logprob, PositionLogprobs
from kvrelay.shared.engine.request import Request
from kvrelay.shared.engine.structured.bitmask import apply_token_bitmask
from kvrelay.shared.wire.sampling_params import SamplingParams

# Bound for the [rows, V] float32 working set of prompt_logprobs (2**26 elements = 256 MiB), so a long
# prompt over a large vocabulary does not materialise its whole log-softmax at once.
_PROMPT_LOGPROBS_CHUNK_ELEMENTS = 1 << 26


# Structured outputs: (indices of the constrained rows [R] int64, their token bitmask [R, W] int32), on the host
GrammarMask = tuple[Tensor, Tensor]


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None  # of token_id under the raw model distribution; None when no row of the step
    # asked for logprobs (computing them costs a full pass over the logits)
    top_logprobs: list[tuple[int, float]] | None  # k best (token id, logprob), highest first; None unless asked


@dataclass
class DeviceSample:
    """One step's draw on the device, before the host reads it."""

    token_ids: Tensor  # [S] int64
    packed: Tensor | None  # [S, 2 + 2k] float64 (``_pack_topk``) when some row asked for logprobs
    wanted: list[int | None]  # each row's logprobs request
    k: int

    def results(self, token_ids: list[int] | None, packed: list[list[float]] | None) -> list[SampleResult]:
        """SampleResults from the host copies: ``packed`` when logprobs were computed, else ``token_ids``."""
        if packed is None:
            return [SampleResult(token_id=t, logprob=None, top_logprobs=None) for t in token_ids]
        k, results = self.k, []
        for row, want in zip(packed, self.wanted, strict=True):
            top = None
            if want is not None:
                ids, lps = row[2 : 2 + k], row[2 + k :]
                top = [(int(ids[j]), lps[j]) for j in range(k if want < 0 else want)]  # -1: all k (the vocabulary)
            results.append(SampleResult(token_id=int(row[0]), logprob=row[1], top_logprobs=top))
        return results


def _to_device(data: list | Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
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
    index = _to_device(_padded(cleaned, vocab), torch.int64, logits.device)  # [S, L]
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
    flat = _to_device((row * vocab + token)[keep], torch.int64, logits.device)  # [N']
    added = _to_device(values[keep], logits.dtype, logits.device)
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
    flat = _to_device((row * vocab + token)[keep], torch.int64, logits.device)  # [N']
    restricted = torch.zeros(num_rows, dtype=torch.bool)
    restricted[rows] = True
    # [S, V]: True where a restricted row may not sample
    banned = _to_device(restricted, torch.bool, logits.device).unsqueeze(1).expand(num_rows, vocab).contiguous()
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
    out_index = _to_device(_padded(output_token_ids, vocab), torch.int64, device)  # [S, Lo]
    if pending is not None:  # -1 (none) goes to the padding column
        out_index = torch.cat((out_index, pending.where(pending >= 0, vocab).unsqueeze(1)), dim=1)  # [S, Lo + 1]
    counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=device)
    counts.scatter_add_(1, out_index, torch.ones_like(out_index, dtype=logits.dtype))
    counts = counts[:, :vocab]  # [S, V] occurrences in the output

    prompt_index = _to_device(_padded(prompt_token_ids, vocab), torch.int64, device)  # [S, Lp]
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


def _pack_topk(logprobs: Tensor, chosen: Tensor, k: int) -> Tensor:
    """[R, 2 + 2k] float64 rows: chosen id, its logprob, k best ids, their logprobs.

    Ids ride as float64 (exact below 2**53) so ids and logprobs leave the device in one transfer.
    logprobs: [R, V]; chosen: [R] int64.
    """
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))  # [R, 1]
    parts = [chosen.unsqueeze(1).double(), chosen_lp.double()]
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)  # [R, k] each, highest first
        parts += [top_ids.double(), top_lp.double()]
    return torch.cat(parts, dim=1)


class Sampler:
    """Samples one token per row. Holds one ``torch.Generator`` per seeded request until ``free``."""

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed  # seeds the shared generator(s) of unseeded rows; None: nondeterministic
        self._shared: dict[torch.device, torch.Generator] = {}
        self._generators: dict[str, torch.Generator] = {}
        # request id -> (its logit_bias dict, that dict as host tensors), until ``free``
        self._biases: dict[str, tuple[dict[int, float], tuple[Tensor, Tensor]]] = {}
        self._allowed: dict[str, tuple[list[int], Tensor]] = {}  # request id -> allowed_token_ids as a tensor

    def free(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._biases.pop(request_id, None)
        self._allowed.pop(request_id, None)

    def _bias_tensors(self, request: Request) -> tuple[Tensor, Tensor] | None:
        bias = request.sampling_params.logit_bias
        if not bias:
            return None
        cached = self._biases.get(request.request_id)
        if cached is None or cached[0] is not bias:  # "is": a reused id with other params is rebuilt
            cached = self._biases[request.request_id] = (bias, logit_bias_tensors(bias))
        return cached[1]

    def _allowed_tensor(self, request: Request) -> Tensor | None:
        allowed = request.sampling_params.allowed_token_ids
        if not allowed:
            return None
        cached = self._allowed.get(request.request_id)
        if cached is None or cached[0] is not allowed:  # "is": a reused id with other params is rebuilt
            cached = self._allowed[request.request_id] = (allowed, torch.tensor(allowed, dtype=torch.int64))
        return cached[1]

    def restart_shared_stream(self) -> None:
        """Unseeded rows draw from the start of the --seed stream again, as in a fresh engine (after warm-up)."""
        self._shared.clear()

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._shared.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._shared[device] = gen
        return gen

    def _request_generator(self, request: Request, device: torch.device) -> torch.Generator:
        # Seeded once per request id: later steps continue the same stream, which is what makes a
        # seeded request reproducible (and survive preemption by recompute, since its id is kept).
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(request.sampling_params.seed)
            self._generators[request.request_id] = gen
        return gen

    def __call__(self, logits: Tensor, requests: list[Request], grammar: GrammarMask | None = None
                 ) -> list[SampleResult]:
        """logits: [S, V] float32, row i for requests[i]. Returns one SampleResult per row."""
        if logits.shape[0] != len(requests):
            raise ValueError(f"logits have {logits.shape[0]} rows for {len(requests)} requests")
        if not requests:
            return []
        drawn = self.sample(logits, requests, grammar=grammar)
        packed = None if drawn.packed is None else drawn.packed.tolist()  # the single device -> host transfer
        return drawn.results(drawn.token_ids.tolist() if packed is None else None, packed)

    def sample(self, logits: Tensor, requests: list[Request], pending: Tensor | None = None,
               grammar: GrammarMask | None = None) -> DeviceSample:
        """The draw, left on the device (no host sync): async scheduling feeds the ids to the next step.
        ``pending``: [S] int64 on the device, each row's sampled token the host has not read yet (-1 for
        none), which the penalties count like the output tokens in the host's lists. ``grammar``: the
        constrained rows and their token bitmask, on the host (structured/manager.py ``bitmask``)."""
        device = logits.device
        params = [r.sampling_params for r in requests]
        wanted = [p.logprobs for p in params]
        need_logprobs = any(w is not None for w in wanted)
        # the reported distribution; skipped (a full [S, V] pass) when no row asked for logprobs
        raw_logprobs = logits.float().log_softmax(dim=-1) if need_logprobs else None  # [S, V]

        logits = self._penalize(logits.float(), requests, pending, grammar)
        greedy = [p.greedy for p in params]
        if all(greedy):
            chosen = logits.argmax(dim=-1)  # [S]
        elif device.type == "cuda":
            chosen = self._sample_on_gpu(logits, requests, greedy)
        else:
            sampled = self._sample(logits, requests, greedy)  # [S]
            is_greedy = _to_device(greedy, torch.bool, device)  # [S]
            chosen = torch.where(is_greedy, logits.argmax(dim=-1), sampled)

        if not need_logprobs:
            return DeviceSample(chosen, None, wanted, 0)
        vocab = logits.shape[1]
        k = max((vocab if w < 0 else min(w, vocab) for w in wanted if w is not None), default=0)  # -1: every token
        return DeviceSample(chosen, _pack_topk(raw_logprobs, chosen, k), wanted, k)

    def _penalize(self, logits: Tensor, requests: list[Request], pending: Tensor | None = None,
                  grammar: GrammarMask | None = None) -> Tensor:
        """Steps 1-4 of the module docstring, each skipped when no row in the batch uses it."""
        device = logits.device
        banned: list[list[int]] = []
        for r in requests:
            p = r.sampling_params
            ids: list[int] = []
            if len(r.output_token_ids) + r.num_pending < p.min_tokens:  # pending: sampled, not yet read
                ids = list(p.stop_token_ids)
                if r.eos_token_id is not None:
                    ids.append(r.eos_token_id)
            banned.append(ids)
        if any(banned):
            logits = apply_min_tokens(logits, banned)

        params = [r.sampling_params for r in requests]
        if any(p.logit_bias for p in params):
            logits = apply_logit_bias(logits, [self._bias_tensors(r) for r in requests])
        if any(p.allowed_token_ids for p in params):
            logits = apply_allowed_tokens(logits, [self._allowed_tensor(r) for r in requests])
        if grammar is not None:
            rows, mask = grammar
            logits = apply_token_bitmask(logits, _to_device(rows, torch.int64, device),
                                         _to_device(mask, torch.int32, device))
        if any(penalized(p) for p in params):
            logits = apply_penalties(
                logits,
                [r.prompt_token_ids for r in requests],
                [r.output_token_ids for r in requests],
                _to_device([p.repetition_penalty for p in params], torch.float32, device),
                _to_device([p.frequency_penalty for p in params], torch.float32, device),
                _to_device([p.presence_penalty for p in params], torch.float32, device),
                pending,
            )
        return logits

    def _noise(self, requests: list[Request], greedy: list[bool], shape: torch.Size, device: torch.device) -> Tensor:
        """Exp(1) draws [S, V] for the exponential race: the shared generator's, except that each seeded
        sampled row takes V draws from its own generator (so its stream ignores its batch-mates)."""
        vocab = shape[1]
        noise = torch.empty(shape, dtype=torch.float32, device=device).exponential_(
            generator=self._shared_generator(device))
        for i, (r, g) in enumerate(zip(requests, greedy, strict=True)):
            if r.sampling_params.seed is not None and not g:
                gen = self._request_generator(r, device)
                noise[i] = torch.empty(vocab, dtype=torch.float32, device=device).exponential_(generator=gen)
        return noise

    def _sample(self, logits: Tensor, requests: list[Request], greedy: list[bool]) -> Tensor:
        """Temperature, filters and the exponential race for all rows; greedy rows' values are unused."""
        num_rows, vocab = logits.shape
        device = logits.device
        params = [r.sampling_params for r in requests]
        # Greedy rows divide by 1 so they stay finite; their draw is discarded by the caller.
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        logits = logits / _to_device(temps, torch.float32, device).unsqueeze(1)  # [S, V]

        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        logits = apply_top_k_top_p_min_p(
            logits,
            _to_device(top_k, torch.int64, device) if any(0 < k < vocab for k in top_k) else None,
            _to_device(top_p, torch.float32, device) if any(p < 1 for p in top_p) else None,
            _to_device(min_p, torch.float32, device) if any(p > 0 for p in min_p) else None,
        )
        probs = logits.softmax(dim=-1)  # [S, V]

        # argmax(probs / q) with q ~ Exp(1) i.i.d. is an exact draw from probs (exponential race) and
        # needs no host sync.
        noise = self._noise(requests, greedy, probs.shape, device)
        # exponential_ may return exactly 0 on some backends; 0/0 would be NaN and win argmax.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)

    def _sample_on_gpu(self, logits: Tensor, requests: list[Request], greedy: list[bool]) -> Tensor:
        """The CUDA path of steps 4+: the same draw as ``_sample`` (same filters, same noise streams)
        through kernels.triton.sampling, whose top-k avoids the full sort when no row uses top-p.
        Greedy rows come back as the argmax. All parameters travel in one host -> device copy."""
        try:
            from kvrelay.kernels.triton.sampling import sample_from_logits
        except ImportError:  # a CUDA machine without triton: the portable path
            sampled = self._sample(logits, requests, greedy)
            return torch.where(_to_device(greedy, torch.bool, logits.device), logits.argmax(dim=-1), sampled)
        vocab = logits.shape[1]
        params = [r.sampling_params for r in requests]
        table = [[0.0 if g else p.temperature, float(p.top_k), p.top_p, p.min_p]
                 for p, g in zip(params, greedy, strict=True)]
        temperature, top_k, top_p, min_p = _to_device(table, torch.float32, logits.device).unbind(1)  # 4 x [S]
        ks = [p.top_k for p in params if 0 < p.top_k < vocab]
        use_top_p = any(p.top_p < 1 for p in params)
        noise = self._noise(requests, greedy, logits.shape, logits.device)
        return sample_from_logits(
            logits, temperature,
            top_k=top_k.long() if ks else None,  # exact: k < 2**24
            top_p=top_p if use_top_p else None,
            min_p=min_p if any(p.min_p > 0 for p in params) else None,
            noise=noise,
            top_k_bound=max(ks) if ks and not use_top_p else None,
        )


def prompt_logprobs(logits: Tensor, next_token_ids: list[int], k: int) -> list[PositionLogprobs]:
    """Per prompt position: {actual next token: its logprob and TRUE rank in the vocabulary, then the k best
    tokens with ranks 1..k}, as vLLM reports them.

    logits: [q, V], row j predicting ``next_token_ids[j]``. Each dict holds k or k + 1 entries (the
    actual token first, as vLLM orders them). Raw distribution, like the sampled-token logprobs. The
    actual token's rank counts the tokens at least as likely as it (itself included), vLLM's rule, so a
    token tied with the top-1 reports the tie's last rank.
    """
    num_rows, vocab = logits.shape
    if num_rows != len(next_token_ids):
        raise ValueError(f"{num_rows} logit rows for {len(next_token_ids)} next tokens")
    if num_rows == 0:
        return []
    k = vocab if k < 0 else min(k, vocab)  # -1: the whole vocabulary
    targets = _to_device(next_token_ids, torch.int64, logits.device)  # [q]
    chunk = max(1, _PROMPT_LOGPROBS_CHUNK_ELEMENTS // vocab)
    packed_chunks = []
    for start in range(0, num_rows, chunk):
        lp = logits[start : start + chunk].float().log_softmax(dim=-1)  # [c, V]
        rows = targets[start : start + chunk]
        packed = _pack_topk(lp, rows, k)
        rank = (lp >= lp.gather(1, rows.unsqueeze(1))).sum(dim=1, keepdim=True)  # [c, 1]
        packed_chunks.append(torch.cat([packed, rank.double()], dim=1))
    packed_rows = torch.cat(packed_chunks).tolist()  # one transfer for the whole prompt
    out = []
    for row in packed_rows:
        entry = {int(row[0]): Logprob(row[1], rank=int(row[-1]))}
        for j in range(k):
            entry.setdefault(int(row[2 + j]), Logprob(row[2 + k + j], rank=j + 1))
        out.append(entry)
    return out


__all__ = [
    "DeviceSample",
    "GrammarMask",
    "SampleResult",
    "Sampler",
    "apply_allowed_tokens",
    "apply_logit_bias",
    "apply_min_tokens",
    "apply_penalties",
    "apply_top_k_top_p_min_p",
    "logit_bias_tensors",
    "penalized",
    "prompt_logprobs",
]
