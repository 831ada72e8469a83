"""Beam search over the engine, with HF transformers' semantics (``early_stopping=False``).

Each step asks the engine for one token of every live beam with its top-k logprobs; the prefix
cache makes a beam's re-submitted prefix nearly free. Which candidates survive a step, and when the
search ends, is shared/text/beam_scoring.py's, which the API's search (gateway/api/beam_search.py) uses too.
"""

from dataclasses import dataclass

from kvrelay.shared.engine.outputs import CompletionOutput, RequestOutput
from kvrelay.shared.text.beam_scoring import BeamState, Candidate, advance, best_candidates, keep_for
from kvrelay.shared.wire.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass
class PromptSearch(BeamState):
    prompt: str | None = None


def beam_search(engine, prompts, params: SamplingParams) -> list[RequestOutput]:
    width, max_tokens, penalty = params.beam_width, params.max_tokens, params.length_penalty
    eos = set(engine.eos_ids) | set(params.stop_token_ids)
    keep = keep_for(width, len(eos))
    if keep > MAX_LOGPROBS:
        raise ValueError(f"beam_width {width} needs {keep} logprobs per step; at most {MAX_LOGPROBS} are supported")
    searches = [PromptSearch(ids, prompt=prompt) for prompt, ids in map(engine.tokenize, prompts)]
    step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=keep, ignore_eos=True)
    for step in range(max_tokens):
        active = [s for s in searches if s.open]
        if not active:
            break
        requests = [{"prompt_token_ids": s.prompt_ids + b.tokens} for s in active for b in s.live]
        outs = iter(engine.generate(requests, step_params))
        for search in active:
            candidates = []
            for beam in search.live:
                entry = next(outs).outputs[0].logprobs[0]
                candidates += [Candidate(beam.score + lp.logprob, beam, tok) for tok, lp in entry.items()]
            advance(search, best_candidates(candidates, keep), width, eos, penalty, last=step + 1 == max_tokens)
    return [_to_output(i, s, params, engine) for i, s in enumerate(searches)]


def _to_output(index: int, search: PromptSearch, params: SamplingParams, engine) -> RequestOutput:
    outputs = []
    for i, (_, beam) in enumerate(search.done[:params.n]):
        text = engine.tokenizer.decode(beam.tokens, skip_special_tokens=params.skip_special_tokens) \
            if engine.tokenizer is not None else ""
        finish = "stop" if beam.tokens and beam.tokens[-1] in set(engine.eos_ids) else "length"
        outputs.append(CompletionOutput(index=i, text=text, token_ids=beam.tokens,
                                        cumulative_logprob=beam.score, finish_reason=finish))
    return RequestOutput(request_id=f"beam-{index}", prompt=search.prompt, prompt_token_ids=search.prompt_ids,
                         outputs=outputs, finished=True)
