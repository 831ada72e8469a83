"""Beam search's bookkeeping, with Hugging Face transformers' semantics (``early_stopping=False``), shared by
the offline engine's search (shared/engine/beam_search.py) and the API's (gateway/api/beam_search.py), which
differ only in how a step's logprobs are fetched. Pure Python, importing nothing: the gateway may import it
(no torch, no engine).

Per prompt and step: the best ``keep = max(2, 1 + #eos) * width`` (beam score + token logprob) candidates;
among the first ``width``, those ending in EOS (or at max_tokens) become hypotheses scored
``sum_logprob / generated_len ** length_penalty``; the best ``width`` others stay live; the search ends once
no live beam can beat the worst kept hypothesis.
"""

from dataclasses import dataclass, field
from typing import Any, NamedTuple


@dataclass
class Beam:
    tokens: list[int]  # generated tokens only
    score: float  # sum of the tokens' logprobs
    trace: list[Any] = field(default_factory=list)  # per token, what the caller attached to its candidate


class Candidate(NamedTuple):
    score: float  # the beam's score with the token's logprob added
    beam: Beam
    token: int
    info: Any = None  # kept in the extended beam's trace when not None (the API's logprobs)


@dataclass
class BeamState:
    """One prompt's search."""
    prompt_ids: list[int]
    live: list[Beam] = field(default_factory=lambda: [Beam([], 0.0)])
    done: list[tuple[float, Beam]] = field(default_factory=list)  # (normalized score, beam), best first
    open: bool = True


def keep_for(width: int, num_eos: int) -> int:
    """Candidates kept per step (and so logprobs asked for per beam): enough that ``width`` survive even if
    every end token ranks first."""
    return max(2, 1 + num_eos) * width


def best_candidates(candidates: list[Candidate], keep: int) -> list[Candidate]:
    return sorted(candidates, key=lambda c: -c.score)[:keep]


def advance(search: BeamState, candidates: list[Candidate], width: int, eos: set[int], penalty: float,
            last: bool) -> None:
    """One step: ``candidates`` (best first) become the hypotheses and live beams of ``search``."""
    gen_len = len(search.live[0].tokens) + 1
    improvable = _improvable(search, width, penalty, gen_len - 1) if gen_len > 1 else True
    next_live = []
    for rank, c in enumerate(candidates):
        if c.token in eos or last:
            if rank < width and improvable:
                search.done.append((c.score / gen_len ** penalty, _extend(c)))
        elif len(next_live) < width:
            next_live.append(_extend(c))
    search.done = sorted(search.done, key=lambda d: -d[0])[:width]
    search.live = next_live
    search.open = bool(next_live) and not last and _improvable(search, width, penalty, gen_len)


def _extend(c: Candidate) -> Beam:
    return Beam(c.beam.tokens + [c.token], c.score, c.beam.trace + ([c.info] if c.info is not None else []))


def _improvable(search: BeamState, width: int, penalty: float, gen_len: int) -> bool:
    # Hugging Face's test for early_stopping=False: the best live beam, scored at its current length, against
    # the worst kept hypothesis (an unfilled slot counts as -inf)
    if len(search.done) < width or not search.live:
        return bool(search.live)
    return search.live[0].score / gen_len ** penalty > search.done[-1][0]
