"""Incremental detokenization and stop-string matching for one output sequence.

Transport-agnostic: the offline API and the gateway both feed token ids in and get text deltas out.

``IncrementalDetokenizer`` uses the prefix/read-offset technique of vLLM and HF ``TextStreamer``: each
step decodes a short window of recent tokens twice, once ending at the last emitted token
(``prefix_offset:read_offset``) and once including the new ones (``prefix_offset:``), and emits the
difference. Decoding with context is what keeps SentencePiece's leading-space stripping (``"▁Hi"``
decodes to ``"Hi"`` at the start of a window) and byte-level BPE merges right; a window whose text ends
in U+FFFD is an incomplete UTF-8 sequence (an emoji split over byte tokens) and is held until the
sequence completes.

``StopStringMatcher`` holds back any suffix that could still grow into a stop string, so a partial stop
string never reaches a client, and truncates at the first completed match.
"""

from collections.abc import Sequence
from typing import Protocol

from kvrelay.shared.wire.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as left context for the first output tokens, as in vLLM: enough for a
# SentencePiece space or a multi-token character to resolve, small enough to stay cheap.
_INITIAL_CONTEXT_TOKENS = 5


class Tokenizer(Protocol):
    """What the detokenizer needs: transformers and ``tokenizers.Tokenizer`` objects both fit."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # transformers may "clean up" spaces before punctuation, which depends on text to the right and
        # so cannot be streamed; switch it off where the tokenizer knows the option.
        self._decode_kwargs: dict[str, bool] = {"skip_special_tokens": skip_special_tokens}
        if hasattr(tokenizer, "clean_up_tokenization_spaces"):
            self._decode_kwargs["clean_up_tokenization_spaces"] = False
        # A fast transformers tokenizer decodes through its Rust ``tokenizers`` backend; with the clean-up
        # off, calling that directly gives the same text without ~5 µs of wrapper per call (two calls per
        # streamed token, in the gateway's hot loop).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and getattr(tokenizer, "is_fast", False):
            self._tokenizer = backend
            self._decode_kwargs = {"skip_special_tokens": skip_special_tokens}
        self._prefix_text: str | None = None  # the decoded window [prefix_offset:read_offset], until it moves
        # Only the window [prefix_offset:] of this list is ever decoded again; older ids are dropped.
        self._ids: list[int] = list(prompt_token_ids[-(_INITIAL_CONTEXT_TOKENS + 2) :])
        self._read_offset = len(self._ids)  # ids before this are already reflected in .text
        self._prefix_offset = max(self._read_offset - _INITIAL_CONTEXT_TOKENS, 0)
        self._chunks: list[str] = []
        self.token_ids: list[int] = []  # every output id fed so far

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return "".join(self._chunks)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, **self._decode_kwargs)

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new output ids; returns only the text they complete (possibly "")."""
        self.token_ids.extend(token_ids)
        delta = []
        for token_id in token_ids:
            self._ids.append(token_id)
            piece = self._step()
            if piece:
                delta.append(piece)
        return "".join(delta)

    def _step(self) -> str:
        prefix_text = self._prefix_text
        if prefix_text is None:  # the window only moves when text is emitted: decode it once per move
            prefix_text = self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # Nothing visible yet (a skipped special token) or a UTF-8 sequence still incomplete.
            return ""
        return self._emit(new_text[len(prefix_text) :])

    def _emit(self, piece: str) -> str:
        self._chunks.append(piece)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        # Trim ids that will never be decoded again so long generations do not grow the list.
        if self._prefix_offset > 0:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return piece

    def flush(self) -> str:
        """At the end of generation: emit text still held for an incomplete UTF-8 sequence.

        The tokens will never complete, so they decode as U+FFFD exactly like a one-shot
        ``tokenizer.decode`` of the whole output would.
        """
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""
        return self._emit(new_text[len(prefix_text) :])


class StopStringMatcher:
    """Finds stop strings in streamed text without ever emitting part of one.

    The match that completes first in the text wins (and of those ending at the same character, the
    one starting first), so the result does not depend on how the text was split into deltas.
    """

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = list(stops)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._held = ""  # text received but not yet emitted: a possible start of a stop string
        self.matched: str | None = None

    def feed(self, new_text: str) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the stop string matched by this call or None).

        After a match, further calls return ("", None): text past a stop string is discarded.
        """
        if self.matched is not None:
            return "", None
        if not self.stops:
            return new_text, None
        buffer = self._held + new_text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stops:
            start = buffer.find(stop)
            if start != -1:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        if best is not None:
            end, start, stop = best
            self.matched = stop
            self._held = ""
            return buffer[: end if self.include_stop_str_in_output else start], stop
        hold = self._longest_partial_suffix(buffer)
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], None

    def _longest_partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def flush(self) -> str:
        """Generation ended without a match: the held-back text is ordinary output after all."""
        held, self._held = self._held, ""
        return held


class OutputText:
    """Detokenizer + stop strings for one sequence: ids in, client-ready text deltas out."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.matcher = StopStringMatcher(stop, include_stop_str_in_output)
        self._chunks: list[str] = []

    @classmethod
    def from_params(cls, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> "OutputText":
        return cls(
            tokenizer,
            prompt_token_ids,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )

    @property
    def text(self) -> str:
        """All text emitted to the client so far."""
        return "".join(self._chunks)

    @property
    def stopped(self) -> bool:
        return self.matcher.matched is not None

    def append(self, token_ids: Sequence[int]) -> tuple[str, bool, str | None]:
        """Returns (delta text, stopped by a stop string, that stop string).

        Once stopped, the caller should abort the request; later calls return ("", True, stop).
        """
        if self.stopped:
            return "", True, self.matcher.matched
        delta, stop = self.matcher.feed(self.detokenizer.add(token_ids))
        self._chunks.append(delta)
        return delta, stop is not None, stop

    def finish(self) -> str:
        """Generation ended (eos, stop id, length, abort): the rest of the text, "" after a stop string."""
        if self.stopped:
            return ""
        delta, stop = self.matcher.feed(self.detokenizer.flush())
        if stop is None:
            delta += self.matcher.flush()
        self._chunks.append(delta)
        return delta
