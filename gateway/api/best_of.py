"""``best_of``: sample ``best_of`` choices per prompt and return the ``n`` most likely, ranked by the sum of
their tokens' logprobs (vLLM's ranking for sampled choices; OpenAI documents the same "best"). Every sampled
choice's tokens count in the usage, as both bill them. Not streamable: the best are known only at the end."""

from kvrelay.gateway.api.choice import ChoiceState
from kvrelay.gateway.api.prompts import Prepared


def best_choices(choices: list[ChoiceState], prepared: Prepared) -> list[ChoiceState]:
    """The choices to return, renumbered prompt by prompt; all of them when best_of is not above n."""
    keep = prepared.returned_n
    if keep is None:
        return choices
    out = []
    for p in range(len(prepared.prompts)):
        candidates = [c for c in choices if c.prompt_index == p]
        ranked = sorted(candidates, key=lambda c: -sum(e.logprob or 0.0 for e in c.logprobs or ()))
        for j, choice in enumerate(ranked[:keep]):
            choice.index = p * keep + j
            out.append(choice)
    return out
