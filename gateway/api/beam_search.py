"""``use_beam_search`` through the API: the search runs here, over the workers, as vLLM's API server runs it
over its engine. Workers run one sequence per job, so each step queues one job per live beam (its prompt
the beam's text so far, one greedy token, the best ``keep`` logprobs); the prefix cache makes a beam's
re-sent prefix nearly free. Which candidates survive a step, and when the search ends, is
shared/text/beam_scoring.py's, which the offline engine's search uses too. The ``n`` best hypotheses are the
choices, with each token's logprob and best alternatives when the request asks for logprobs (the step
fetches them anyway); streamed, each choice is one chunk once the search ends (no beam is final before).

What a beam search request may ask for is checked in beam_params.py.
"""

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from kvrelay.gateway.api.choice import TokenLogprob
from kvrelay.gateway.api.generation import Generation
from kvrelay.gateway.api.prompts import Prepared
from kvrelay.gateway.errors import ARRIVAL
from kvrelay.gateway.state import METRICS
from kvrelay.shared.text.beam_scoring import BeamState, Candidate, advance, best_candidates, keep_for
from kvrelay.shared.wire.sampling_params import SamplingParams


@dataclass
class BeamChoice:
    """One returned beam, in the shape the handlers read a choice."""
    index: int
    prompt_index: int
    token_ids: list[int]
    text: str
    finish_reason: str
    cumulative_logprob: float
    logprobs: list[TokenLogprob] | None = None  # when the request asks for logprobs
    stop_reason: None = None
    prompt_logprobs: None = None
    prompt_logprob_ranks: None = None


class BeamSearch:
    """What a Meter reads of a generation (usage, choices), for the search's steps together. The search's TTFT
    is its first step's end: the steps are not whole requests, and observe none."""

    def __init__(self, request: web.Request, prepared: Prepared, request_id: str) -> None:
        self._request = request
        self.prepared = prepared
        self.request_id = request_id
        self.arrival = request.get(ARRIVAL, time.time())
        self.first_token_at: float | None = None
        self.choices: list[BeamChoice] = []
        params = prepared.params
        self._width = params.beam_width or params.n
        self._eos = set(prepared.model.eos_token_ids) | set(params.stop_token_ids)
        self._keep = keep_for(self._width, len(self._eos))
        self._top = params.logprobs  # alternatives per token the request asks for; None: no logprobs

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

    async def finished_choices(self) -> AsyncIterator[BeamChoice]:
        """The choices, once the search has ended: what a streamed response sends."""
        await self.run()
        for choice in self.choices:
            yield choice

    async def run(self) -> None:
        params = self.prepared.params
        searches = [BeamState(list(p)) for p in self.prepared.prompts]
        step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=max(self._keep, self._top or 0),
                              ignore_eos=True, skip_special_tokens=params.skip_special_tokens)
        for i in range(params.max_tokens or 1):
            active = [s for s in searches if s.open]
            if not active:
                break
            prompts = [s.prompt_ids + b.tokens for s in active for b in s.live]
            step_prepared = dataclasses.replace(self.prepared, prompts=prompts, params=step, returned_n=None,
                                                constraint_param=None)
            async with Generation(self._request, step_prepared, whole_request=False) as gen:
                async for _ in gen:
                    pass
            if self.first_token_at is None:
                self.first_token_at = time.time()
                self._request.app[METRICS].ttft.labels(self.prepared.model_name).observe(
                    max(self.first_token_at - self.arrival, 0.0))
            entries = iter(gen.choices)
            for search in active:
                candidates = []
                for beam in search.live:
                    (entry,) = next(entries).logprobs or [None]
                    if entry is None:
                        continue
                    alternatives = entry.top[:self._top] if self._top is not None else None
                    candidates += [Candidate(beam.score + lp, beam, tok,
                                             None if alternatives is None else (tok, text, lp, alternatives))
                                   for tok, text, lp in entry.top[:self._keep]]
                advance(search, best_candidates(candidates, self._keep), self._width, self._eos,
                        params.length_penalty, last=i + 1 == params.max_tokens)
        tokenizer = self.prepared.tokenizer
        for p, search in enumerate(searches):
            for j, (_, beam) in enumerate(search.done[:params.n]):
                self.choices.append(BeamChoice(
                    index=p * params.n + j, prompt_index=p, token_ids=beam.tokens, cumulative_logprob=beam.score,
                    text=tokenizer.decode(beam.tokens, skip_special_tokens=params.skip_special_tokens),
                    finish_reason="stop" if beam.tokens and beam.tokens[-1] in self._eos else "length",
                    logprobs=self._logprobs(beam.trace) if self._top is not None else None))

    def _logprobs(self, trace: list[tuple[int, str, float, list[tuple[int, str, float]]]]) -> list[TokenLogprob]:
        out, offset = [], 0
        for token_id, text, logprob, alternatives in trace:
            out.append(TokenLogprob(token_id=token_id, token=text, logprob=logprob, top=alternatives,
                                    text_offset=offset))
            offset += len(text)
        return out
