"""Turns engine-core token outputs into vLLM-shaped ``RequestOutput`` objects: incremental
detokenization, stop strings (held back until they can no longer start a match), and the fan-in of
``n`` child sequences into one request."""

from dataclasses import dataclass, field

from kvrelay.shared.engine.outputs import CompletionOutput, EngineCoreOutput, RequestOutput
from kvrelay.shared.text.detokenizer import IncrementalDetokenizer, StopStringMatcher
from kvrelay.shared.wire.sampling_params import SamplingParams


class SequenceText:
    """Text of one generated sequence; without a tokenizer (dummy weights) text stays empty."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.detok = (IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
                      if tokenizer is not None else None)
        self.stops = StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None

    def append(self, token_ids: list[int], final: bool) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the stop string that matched or None)."""
        if self.detok is None:
            return "", None
        new = self.detok.add(token_ids)
        if self.stops is None:
            return new, None
        emit, matched = self.stops.feed(new)
        if matched is None and final:
            emit += self.stops.flush()
        return emit, matched


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    child_ids: list[str]
    texts: list[SequenceText]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams, child_ids: list[str]) -> None:
        state = RequestState(
            request_id, prompt, prompt_token_ids, params, child_ids,
            texts=[SequenceText(self.tokenizer, prompt_token_ids, params) for _ in child_ids],
            outputs=[CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None,
                                      cumulative_logprob=0.0 if params.logprobs is not None else None)
                     for i in range(len(child_ids))],
        )
        self.requests[request_id] = state
        for i, cid in enumerate(child_ids):
            self.child_to_parent[cid] = (request_id, i)

    def process(self, core_outputs: list[EngineCoreOutput], delta: bool = False
                ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the updated requests' outputs and the child ids a stop string finished (the
        caller must stop those in the engine core)."""
        touched: dict[str, list[CompletionOutput]] = {}
        to_stop: list[str] = []
        for co in core_outputs:
            if co.request_id not in self.child_to_parent:
                continue  # already finished by a stop string; the core's last word about it
            parent, index = self.child_to_parent[co.request_id]
            state = self.requests[parent]
            out = state.outputs[index]
            new_text, matched = state.texts[index].append(co.new_token_ids, final=co.finished)
            out.text += new_text
            out.token_ids.extend(co.new_token_ids)
            if co.new_logprobs:
                out.logprobs.extend(co.new_logprobs)
                for tok, entry in zip(co.new_token_ids, co.new_logprobs, strict=True):
                    out.cumulative_logprob += entry[tok].logprob
            if co.prompt_logprobs is not None:
                state.prompt_logprobs = co.prompt_logprobs
            state.num_cached_tokens = max(state.num_cached_tokens, co.num_cached_tokens)
            if matched is not None:
                out.finish_reason, out.stop_reason = "stop", matched
                if not co.finished:
                    to_stop.append(co.request_id)
            elif co.finished:
                out.finish_reason, out.stop_reason = co.finish_reason, co.stop_reason
            if out.finished:
                del self.child_to_parent[co.request_id]
            deltas = touched.setdefault(parent, [])
            if delta:
                deltas.append(CompletionOutput(
                    index=index, text=new_text, token_ids=list(co.new_token_ids),
                    cumulative_logprob=out.cumulative_logprob, logprobs=co.new_logprobs,
                    finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                ))
        results = []
        for parent, deltas in touched.items():
            state = self.requests[parent]
            results.append(RequestOutput(
                request_id=parent, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
                outputs=deltas if delta else state.outputs, prompt_logprobs=state.prompt_logprobs,
                finished=state.finished, num_cached_tokens=state.num_cached_tokens,
            ))
            if state.finished:
                del self.requests[parent]
        return results, to_stop

    def abort(self, request_id: str) -> list[str]:
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        for cid in state.child_ids:
            self.child_to_parent.pop(cid, None)
        return state.child_ids
