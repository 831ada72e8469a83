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

The processors of steps 1-5 are logits_processors.py's; logprobs.py packs the logprobs and computes the
prompt's. Steps 1-4 run before greedy and sampled rows part ways, so the CPU path, the CUDA path and the all-greedy
argmax all see the same processed logits.

On CUDA, sampled rows go through ``kernels.triton.sampling.sample_from_logits`` (same filters, same
noise, a sort-free top-k), with every row's parameters in one host -> device copy.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from kvrelay.shared.engine.logits_processors import (
    apply_allowed_tokens,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    apply_top_k_top_p_min_p,
    logit_bias_tensors,
    penalized,
    to_device,
)
from kvrelay.shared.engine.logprobs import pack_topk
from kvrelay.shared.engine.outputs import Logprob, PositionLogprobs
from kvrelay.shared.engine.request import Request
from kvrelay.shared.engine.structured.bitmask import apply_token_bitmask

# Structured outputs: (indices of the constrained rows [R] int64, their token bitmask [R, W] int32), on the host
GrammarMask = tuple[Tensor, Tensor]


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None  # of token_id under the raw model distribution; None when no row of the step
    # asked for logprobs (computing them costs a full pass over the logits)
    top_logprobs: list[tuple[int, float]] | None  # k best (token id, logprob), highest first; None unless asked

    def position_logprobs(self) -> PositionLogprobs:
        """This position as the API reports it: the sampled token, then the k best with their ranks."""
        entry: PositionLogprobs = {self.token_id: Logprob(self.logprob)}
        for rank, (tok, lp) in enumerate(self.top_logprobs or [], start=1):
            if tok == self.token_id:
                entry[tok].rank = rank
            else:
                entry[tok] = Logprob(lp, rank=rank)
        return entry


@dataclass
class DeviceSample:
    """One step's draw on the device, before the host reads it."""

    token_ids: Tensor  # [S] int64
    packed: Tensor | None  # [S, 2 + 2k] float64 (``logprobs.pack_topk``) when some row asked for logprobs
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
            is_greedy = to_device(greedy, torch.bool, device)  # [S]
            chosen = torch.where(is_greedy, logits.argmax(dim=-1), sampled)

        if not need_logprobs:
            return DeviceSample(chosen, None, wanted, 0)
        vocab = logits.shape[1]
        k = max((vocab if w < 0 else min(w, vocab) for w in wanted if w is not None), default=0)  # -1: every token
        return DeviceSample(chosen, pack_topk(raw_logprobs, chosen, k), wanted, k)

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
            logits = apply_token_bitmask(logits, to_device(rows, torch.int64, device),
                                         to_device(mask, torch.int32, device))
        if any(penalized(p) for p in params):
            logits = apply_penalties(
                logits,
                [r.prompt_token_ids for r in requests],
                [r.output_token_ids for r in requests],
                to_device([p.repetition_penalty for p in params], torch.float32, device),
                to_device([p.frequency_penalty for p in params], torch.float32, device),
                to_device([p.presence_penalty for p in params], torch.float32, device),
                pending,
            )
        return logits

    def _noise(self, requests: list[Request], greedy: list[bool], shape: torch.Size, device: torch.device) -> Tensor:
        """Exp(1) draws [S, V] for the exponential race: the shared generator's, except that each seeded
        sampled row takes V draws from its own generator (so its stream ignores its batch-mates). A batch with
        no unseeded sampled row leaves the shared stream alone: its [S, V] draw would all be overwritten or
        unused (greedy rows' draws are discarded, so they get ones)."""
        own = [r.sampling_params.seed is not None and not g for r, g in zip(requests, greedy, strict=True)]
        noise = torch.empty(shape, dtype=torch.float32, device=device)
        if all(o or g for o, g in zip(own, greedy, strict=True)):
            noise.fill_(1.0)
        else:
            noise.exponential_(generator=self._shared_generator(device))
        for i, r in enumerate(requests):
            if own[i]:
                gen = self._request_generator(r, device)
                noise[i] = torch.empty(shape[1], dtype=torch.float32, device=device).exponential_(generator=gen)
        return noise

    def _sample(self, logits: Tensor, requests: list[Request], greedy: list[bool]) -> Tensor:
        """Temperature, filters and the exponential race for all rows; greedy rows' values are unused."""
        num_rows, vocab = logits.shape
        device = logits.device
        params = [r.sampling_params for r in requests]
        # Greedy rows divide by 1 so they stay finite; their draw is discarded by the caller.
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        logits = logits / to_device(temps, torch.float32, device).unsqueeze(1)  # [S, V]

        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        logits = apply_top_k_top_p_min_p(
            logits,
            to_device(top_k, torch.int64, device) if any(0 < k < vocab for k in top_k) else None,
            to_device(top_p, torch.float32, device) if any(p < 1 for p in top_p) else None,
            to_device(min_p, torch.float32, device) if any(p > 0 for p in min_p) else None,
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
            return torch.where(to_device(greedy, torch.bool, logits.device), logits.argmax(dim=-1), sampled)
        vocab = logits.shape[1]
        params = [r.sampling_params for r in requests]
        table = [[0.0 if g else p.temperature, float(p.top_k), p.top_p, p.min_p]
                 for p, g in zip(params, greedy, strict=True)]
        temperature, top_k, top_p, min_p = to_device(table, torch.float32, logits.device).unbind(1)  # 4 x [S]
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
