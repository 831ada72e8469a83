"""Beam search over the engine, with HF transformers' semantics (``early_stopping=False``).

Each step asks the engine for one token of every live beam with its top-k logprobs; the prefix
cache makes a beam's re-submitted prefix nearly free. Per prompt, every step:
  candidates = the best ``keep = max(2, 1 + #eos) * width`` (beam score + token logprob) pairs;
  among the first ``width`` candidates, those ending in EOS (or reaching max_tokens) become
  hypotheses scored ``sum_logprob / generated_len ** length_penalty``; the best ``width`` others
  stay live; the search ends once no live beam can beat the worst kept hypothesis.
"""

from dataclasses import dataclass, field

from kvrelay.shared.engine.outputs import CompletionOutput, RequestOutput
from kvrelay.shared.wire.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass
class Beam:
    tokens: list[int]  # generated tokens only
    score: float  # sum of token logprobs


@dataclass
class PromptSearch:
    prompt: str | None
    prompt_ids: list[int]
    live: list[Beam] = field(default_factory=lambda: [Beam([], 0.0)])
    done: list[tuple[float, Beam]] = field(default_factory=list)  # (normalized score, beam), best first
    open: bool = True


def beam_search(engine, prompts, params: SamplingParams) -> list[RequestOutput]:
    width, max_tokens, penalty = params.beam_width, params.max_tokens, params.length_penalty
    eos = set(engine.eos_ids) | set(params.stop_token_ids)
    keep = max(2, 1 + len(eos)) * width
    if keep > MAX_LOGPROBS:
        raise ValueError(f"beam_width {width} needs {keep} logprobs per step; at most {MAX_LOGPROBS} are supported")
    searches = [PromptSearch(*engine.tokenize(p)) for p in prompts]
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
                candidates += [(beam.score + lp.logprob, beam, tok) for tok, lp in entry.items()]
            candidates.sort(key=lambda c: -c[0])
            _advance(search, candidates[:keep], width, eos, penalty, last=step + 1 == max_tokens)
    return [_to_output(i, s, params, engine) for i, s in enumerate(searches)]


def _advance(search: PromptSearch, candidates, width, eos, penalty, last: bool) -> None:
    gen_len = len(search.live[0].tokens) + 1
    improvable = _improvable(search, width, penalty, gen_len - 1) if gen_len > 1 else True
    next_live = []
    for rank, (score, beam, tok) in enumerate(candidates):
        ends = tok in eos or last
        if ends:
            if rank < width and improvable:
                search.done.append((score / gen_len**penalty, Beam(beam.tokens + [tok], score)))
        elif len(next_live) < width:
            next_live.append(Beam(beam.tokens + [tok], score))
    search.done = sorted(search.done, key=lambda d: -d[0])[:width]
    search.live = next_live
    search.open = bool(next_live) and not last and _improvable(search, width, penalty, gen_len)


def _improvable(search: PromptSearch, width: int, penalty: float, gen_len: int) -> bool:
    # HF's heuristic for early_stopping=False: the best live beam, scored at its current length,
    # against the worst kept hypothesis (an unfilled slot counts as -inf)
    if len(search.done) < width or not search.live:
        return bool(search.live)
    return search.live[0].score / gen_len**penalty > search.done[-1][0]


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
