"""``use_beam_search`` through the API: the search runs here, over the workers, as vLLM's API server runs it
over its engine. Workers run one sequence per job, so each step queues one job per live beam (its prompt
the beam's text so far, one greedy token, the best ``keep`` logprobs); the prefix cache makes a beam's
re-sent prefix nearly free. The scoring is the offline engine's (shared/engine/beam_search.py, Hugging
Face's ``early_stopping=False``): per prompt and step, the best ``keep = max(2, 1 + #eos) * width``
(beam score + token logprob) pairs; among the first ``width``, those ending in EOS (or at max_tokens) become
hypotheses scored ``sum_logprob / generated_len ** length_penalty``; the best ``width`` others stay live;
the search ends once no live beam can beat the worst kept hypothesis. The ``n`` best hypotheses are the
choices.

What a beam search request may ask for is checked in beam_params.py.
"""

import dataclasses
import time
from dataclasses import dataclass, field

from aiohttp import web

from kvrelay.gateway.api.generation import Generation
from kvrelay.gateway.api.prompts import Prepared
from kvrelay.shared.wire.sampling_params import SamplingParams


@dataclass
class Beam:
    tokens: list[int]  # generated tokens only
    score: float  # sum of the tokens' logprobs


@dataclass
class _Search:
    prompt_ids: list[int]
    live: list[Beam] = field(default_factory=lambda: [Beam([], 0.0)])
    done: list[tuple[float, Beam]] = field(default_factory=list)  # (normalized score, beam), best first
    open: bool = True


@dataclass
class BeamChoice:
    """One returned beam, in the shape the handlers read a choice."""
    index: int
    prompt_index: int
    token_ids: list[int]
    text: str
    finish_reason: str
    cumulative_logprob: float
    stop_reason: None = None
    logprobs: None = None
    prompt_logprobs: None = None
    prompt_logprob_ranks: None = None


class BeamSearch:
    """What a Meter reads of a generation (usage, arrival, first token), for the search's steps together."""

    def __init__(self, request: web.Request, prepared: Prepared, request_id: str) -> None:
        self._request = request
        self.prepared = prepared
        self.request_id = request_id
        self.arrival = time.time()
        self.first_token_at: float | None = None
        self.choices: list[BeamChoice] = []
        params = prepared.params
        self._width = params.beam_width or params.n
        self._eos = set(prepared.model.eos_token_ids) | set(params.stop_token_ids)
        self._keep = max(2, 1 + len(self._eos)) * self._width

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prepared.prompts)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def usage(self) -> dict:
        prompt, completion = self.num_prompt_tokens, self.num_completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": None}

    async def run(self) -> None:
        params = self.prepared.params
        searches = [_Search(list(p)) for p in self.prepared.prompts]
        step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=self._keep, ignore_eos=True,
                              skip_special_tokens=params.skip_special_tokens)
        for i in range(params.max_tokens or 1):
            active = [s for s in searches if s.open]
            if not active:
                break
            prompts = [s.prompt_ids + b.tokens for s in active for b in s.live]
            step_prepared = dataclasses.replace(self.prepared, prompts=prompts, params=step, returned_n=None,
                                                constraint_param=None)
            async with Generation(self._request, step_prepared) as gen:
                async for _ in gen:
                    pass
            if self.first_token_at is None:
                self.first_token_at = time.time()
            entries = iter(gen.choices)
            for search in active:
                candidates = []
                for beam in search.live:
                    (entry,) = next(entries).logprobs or [None]
                    candidates += [(beam.score + lp, beam, tok) for tok, _, lp in entry.top] if entry else []
                candidates.sort(key=lambda c: -c[0])
                self._advance(search, candidates[:self._keep], last=i + 1 == params.max_tokens)
        tokenizer = self.prepared.tokenizer
        for p, search in enumerate(searches):
            for j, (_, beam) in enumerate(search.done[:params.n]):
                self.choices.append(BeamChoice(
                    index=p * params.n + j, prompt_index=p, token_ids=beam.tokens, cumulative_logprob=beam.score,
                    text=tokenizer.decode(beam.tokens, skip_special_tokens=params.skip_special_tokens),
                    finish_reason="stop" if beam.tokens and beam.tokens[-1] in self._eos else "length"))

    def _advance(self, search: _Search, candidates: list, last: bool) -> None:
        width, penalty = self._width, self.prepared.params.length_penalty
        gen_len = len(search.live[0].tokens) + 1
        improvable = _improvable(search, width, penalty, gen_len - 1) if gen_len > 1 else True
        next_live = []
        for rank, (score, beam, tok) in enumerate(candidates):
            if tok in self._eos or last:
                if rank < width and improvable:
                    search.done.append((score / gen_len ** penalty, Beam(beam.tokens + [tok], score)))
            elif len(next_live) < width:
                next_live.append(Beam(beam.tokens + [tok], score))
        search.done = sorted(search.done, key=lambda d: -d[0])[:width]
        search.live = next_live
        search.open = bool(next_live) and not last and _improvable(search, width, penalty, gen_len)


def _improvable(search: _Search, width: int, penalty: float, gen_len: int) -> bool:
    # Hugging Face's test for early_stopping=False: the best live beam, scored at its current length, against
    # the worst kept hypothesis (an unfilled slot counts as -inf)
    if len(search.done) < width or not search.live:
        return bool(search.live)
    return search.live[0].score / gen_len ** penalty > search.done[-1][0]
