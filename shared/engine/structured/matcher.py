"""One sequence's grammar state: its compile (a Future until done), then an xgrammar matcher that is
advanced over the tokens the sequence has generated, lazily, right before its next mask is filled.

Advancing from ``output_token_ids`` rather than from each sampled id as it arrives is what makes every
path the same: synchronous and async steps (the ids reach the host a step late), a decode worker that
continues a sequence whose first token the prefill worker sampled (its matcher starts empty and catches
up over that token), and a sequence preempted and recomputed (its tokens are kept, so is its matcher).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from kvrelay.shared.engine.structured.utf8 import COMPLETE, REJECT
from kvrelay.shared.wire.structured_outputs import StructuredOutputs

if TYPE_CHECKING:
    from kvrelay.shared.engine.structured.backend import GrammarBackend


class GrammarViolation(RuntimeError):
    """A token the grammar does not accept reached a constrained sequence (a bug, or a token forced from
    outside the mask)."""


class SequenceGrammar:
    def __init__(self, constraint: StructuredOutputs, compiled: Future) -> None:
        self.constraint = constraint
        self.compiled = compiled
        self.matcher = None
        self.num_accepted = 0  # output tokens the matcher has consumed
        self.utf8_state = COMPLETE  # what the last character of those tokens' bytes still needs (utf8.py)
        self._allowed: torch.Tensor | None = None  # the request's allowed_token_ids as mask bits, built once

    @property
    def ready(self) -> bool:
        return self.compiled.done()

    @property
    def error(self) -> str | None:
        """Why the constraint did not compile (a message naming ``structured_outputs.<kind>``); None while
        compiling or when it compiled."""
        if not self.compiled.done():
            return None
        exc = self.compiled.exception()
        return None if exc is None else str(exc)

    def catch_up(self, backend: GrammarBackend, output_token_ids: list[int], stop_token_ids: list[int]) -> None:
        """Advance over the outputs not consumed yet (waits for the compile when it is still running)."""
        if self.matcher is None:
            self.matcher = backend.matcher(self.compiled.result(), stop_token_ids)
        while self.num_accepted < len(output_token_ids):
            token = output_token_ids[self.num_accepted]
            if not self.matcher.accept_token(token):
                raise GrammarViolation(f"token {token} at output position {self.num_accepted} breaks the "
                                       f"{self.constraint.kind} constraint")
            state = backend.utf8.advance(self.utf8_state, token)
            if state == REJECT:
                raise GrammarViolation(f"token {token} at output position {self.num_accepted} makes the output "
                                       "invalid UTF-8")
            self.utf8_state = state
            self.num_accepted += 1

    def allowed_mask(self, allowed_token_ids: list[int], words: int) -> torch.Tensor:
        """[words] int32: bit t set for each allowed id t below 32 * words (ids past the mask are forbidden
        by it anyway)."""
        if self._allowed is None:
            bits = torch.zeros(words * 32, dtype=torch.bool)
            ids = torch.tensor([t for t in allowed_token_ids if 0 <= t < words * 32], dtype=torch.int64)
            bits[ids] = True
            weights = torch.tensor([1 << i for i in range(31)] + [-(2**31)], dtype=torch.int64)
            self._allowed = (bits.view(words, 32).long() * weights).sum(1).to(torch.int32)
        return self._allowed

    @property
    def completed(self) -> bool:
        """The grammar is complete: only a stop token may follow."""
        return self.matcher is not None and self.matcher.is_completed()
