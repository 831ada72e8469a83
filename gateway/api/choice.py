"""One output choice (one job): token events in, client-ready deltas out.

Events are applied in ``output_index`` order (prefill and decode workers send over different sockets),
duplicates dropped.

Text goes through the incremental detokenizer, then the stop-string matcher, which holds back anything
that might still become a stop string; a matched stop string ends the choice here (the caller aborts
the job). Token ids and logprobs are reported up to and including the token that completed the stop.
"""

import dataclasses
from dataclasses import dataclass, field

from kvrelay.gateway.api.tokenizer_pool import ModelTokenizer
from kvrelay.shared.text.detokenizer import IncrementalDetokenizer, StopStringMatcher
from kvrelay.shared.wire.protocol import TokenEvent
from kvrelay.shared.wire.sampling_params import SamplingParams

# JSON has no -inf; vLLM reports impossible tokens as -9999.0 as well.
_MIN_LOGPROB = -9999.0
# Events buffered while waiting for an earlier one; past this the earlier one is taken as lost.
_MAX_PENDING_EVENTS = 4096


def _first(items: list, k: int) -> list:
    """The first k; k = -1 (the whole vocabulary) is all of them."""
    return items if k < 0 else items[:k]


@dataclass
class TokenLogprob:
    token_id: int
    token: str  # the token on its own, decoded
    logprob: float | None  # None: the worker sent no logprob for it
    top: list[tuple[int, str, float]]  # (id, text, logprob) of the alternatives, most likely first
    text_offset: int  # where the token's text starts in the choice's output text


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class ChoiceState:
    index: int  # position in the response's choices
    job_id: str
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    tokenizer: ModelTokenizer
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list | None = None
    prompt_logprob_ranks: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    worker_finished: bool = False  # the worker ended the job itself (else the gateway must abort it)

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.tokenizer.hf, self.prompt_token_ids,
                                             self.params.skip_special_tokens)
        self._stops = StopStringMatcher(self.params.stop, self.params.include_stop_str_in_output)
        self._raw_len = 0  # characters the detokenizer produced, before stop handling
        self._next_index = 0  # output_index of the next event to apply
        self._pending: dict[int, TokenEvent] = {}  # events that arrived ahead of their turn
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stopped_by_string(self) -> bool:
        return self._stops.matched is not None

    def receive(self, event: TokenEvent) -> ChoiceDelta | None:
        """Apply ``event`` and any buffered events it makes contiguous; None if nothing is ready."""
        if self.finished:
            return None
        ready = self._in_order(event)
        if not ready:
            return None
        delta = ChoiceDelta(self.index, "", [], [] if self.logprobs is not None else None)
        pieces: list[str] = []
        for ev in ready:
            self._apply(ev, delta, pieces)
            if self.finished:
                break
        delta.text = "".join(pieces)
        delta.finish_reason, delta.stop_reason = self.finish_reason, self.stop_reason
        self.text += delta.text
        return delta

    def _in_order(self, event: TokenEvent) -> list[TokenEvent]:
        """Events in output order. Ahead of the expected index: buffer. Behind it: a duplicate (a job
        delivered twice, a late message from a worker that handed the request on), so keep only tokens
        not seen yet; but a worker's verdict that the request failed ends it wherever it stands: one
        that never ran it (a dead-lettered job after its worker died) sends it as of output index 0."""
        index = event.output_index
        if index < self._next_index and not event.token_ids and event.finish_reason == "error":
            event = dataclasses.replace(event, output_index=self._next_index)
            index = self._next_index
        if index > self._next_index:
            if len(self._pending) >= _MAX_PENDING_EVENTS:
                return [TokenEvent(self.job_id, finish_reason="error", output_index=self._next_index,
                                   error="token events arrived too far out of order")]
            self._pending.setdefault(index, event)
            return []
        if index < self._next_index:
            overlap = self._next_index - index
            seen = min(overlap, len(event.token_ids))
            if event.token_ids[:seen] != self.token_ids[index:index + seen]:
                # a replacement worker re-ran the job from its start (its worker died) and sampled another
                # text: what the client already has cannot be continued
                return [TokenEvent(self.job_id, finish_reason="error", output_index=self._next_index,
                                   error="the worker serving this request was lost and its replacement "
                                         "generated a different text; retry the request")]
            if overlap >= len(event.token_ids):
                return []
            event = dataclasses.replace(
                event, token_ids=event.token_ids[overlap:], output_index=self._next_index,
                logprobs=None if event.logprobs is None else event.logprobs[overlap:],
                top_logprobs=None if event.top_logprobs is None else event.top_logprobs[overlap:])
        ready = [event]
        self._next_index += len(event.token_ids)
        while not event.finished and self._next_index in self._pending:
            event = self._pending.pop(self._next_index)
            ready.append(event)
            self._next_index += len(event.token_ids)
        return ready

    def _apply(self, event: TokenEvent, delta: ChoiceDelta, pieces: list[str]) -> None:
        if event.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = event.prompt_logprobs
            self.prompt_logprob_ranks = event.prompt_logprob_ranks
        self.num_cached_tokens = max(self.num_cached_tokens, event.num_cached_tokens)
        # EOS or a stop token id ends generation; its text is not output unless asked for (vLLM).
        stop_token = (event.finish_reason == "stop" and not isinstance(event.stop_reason, str)
                      and not self.params.include_stop_str_in_output)
        last = len(event.token_ids) - 1
        for i, token_id in enumerate(event.token_ids):
            self.token_ids.append(token_id)
            delta.token_ids.append(token_id)
            raw = "" if (stop_token and i == last) else self._detok.add([token_id])
            if self.logprobs is not None:
                entry = self._logprob_entry(event, i, token_id)
                self.logprobs.append(entry)
                delta.logprobs.append(entry)
            self._raw_len += len(raw)
            pieces.append(self._filter(raw))
            if self.stopped_by_string:
                break  # anything after the stop string is discarded, tokens included
        if not self.stopped_by_string and event.finished:
            pieces.append(self._filter(self._detok.flush()))
            if not self.stopped_by_string:
                pieces.append(self._stops.flush())
                self.finish_reason, self.stop_reason = event.finish_reason, event.stop_reason
                self.error = event.error
                self.worker_finished = True
        if self.stopped_by_string:
            self.finish_reason, self.stop_reason = "stop", self._stops.matched
            self.worker_finished = event.finished

    def _filter(self, raw: str) -> str:
        """Stop strings do not apply before min_tokens (vLLM): such text passes straight through."""
        if not raw or len(self.token_ids) < self.params.min_tokens:
            return raw
        emit, _ = self._stops.feed(raw)
        return emit

    def _logprob_entry(self, event: TokenEvent, i: int, token_id: int) -> TokenLogprob:
        text = self.tokenizer.token_text
        logprob = max(event.logprobs[i], _MIN_LOGPROB) if event.logprobs is not None else None
        top = event.top_logprobs[i] if event.top_logprobs is not None else []
        return TokenLogprob(
            token_id=token_id, token=text(token_id), logprob=logprob,
            top=[(tid, text(tid), max(lp, _MIN_LOGPROB)) for tid, lp in _first(top, self.params.logprobs or 0)],
            text_offset=self._raw_len,
        )
