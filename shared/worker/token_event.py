"""An engine output as the wire's ``TokenEvent``, the one shape every role sends its tokens back in."""

import time

from kvrelay.shared.engine.outputs import EngineCoreOutput
from kvrelay.shared.wire.protocol import TokenEvent
from kvrelay.shared.worker.lifecycle import InFlight


def token_event(out: EngineCoreOutput, output_index: int, worker_id: str) -> TokenEvent:
    """EngineCoreOutput -> the wire's TokenEvent (logprob dicts become [id, logprob] lists)."""
    logprobs = top = None
    if out.new_logprobs is not None:
        logprobs = [entry[tok].logprob for tok, entry in zip(out.new_token_ids, out.new_logprobs, strict=True)]
        top = [[(t, lp.logprob) for t, lp in entry.items() if lp.rank is not None]
               for entry in out.new_logprobs]
        top = [sorted(t, key=lambda x: -x[1]) for t in top]
    prompt_lp = prompt_ranks = None
    if out.prompt_logprobs is not None:  # dict order kept: the prompt token first, then the best k
        prompt_lp = [None if e is None else [(t, lp.logprob) for t, lp in e.items()] for e in out.prompt_logprobs]
        prompt_ranks = [None if e is None else [lp.rank or 0 for lp in e.values()] for e in out.prompt_logprobs]
    return TokenEvent(request_id=out.request_id, token_ids=out.new_token_ids, logprobs=logprobs, top_logprobs=top,
                      prompt_logprobs=prompt_lp, prompt_logprob_ranks=prompt_ranks,
                      finish_reason=out.finish_reason, error=out.error,
                      stop_reason=out.stop_reason if isinstance(out.stop_reason, int | str) else None,
                      num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
                      output_index=output_index, worker_id=worker_id)


def stamp_first_token(event: TokenEvent, rec: InFlight, step_started: float) -> None:
    """Carry the first token's way through this worker (wall clocks, as the gateway's are) on ``event``,
    for the gateway's TTFT stages; a job that did not come from a stream (``fetched_at`` 0) has none."""
    if rec.fetched_at and event.token_ids and event.output_index == 0:
        event.first_token_times = {"fetched": rec.fetched_at, "step_started": step_started, "sampled": time.time()}
        event.fetch_asked = rec.asked_at or None
