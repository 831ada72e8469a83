"""Which tokens keep a constrained output valid UTF-8 (RFC 3629), given the bytes generated so far.

xgrammar 0.2.9 lets some invalid UTF-8 through its byte-level matching: surrogates (ED A0..BF xx, U+D800..DFFF)
under every grammar kind, and overlong 3- and 4-byte forms (E0 80..9F xx, F0 80..8F xx xx) inside a JSON
schema's ``pattern`` strings, which is how the engine writes length-bounded strings (json_strings.py). Such
bytes decode to U+FFFD replacement characters, three where the grammar counted one character.

A sequence's UTF-8 state is what its last, possibly incomplete, character still needs: one of ``STATES``
(0: complete), so a character may span tokens. For each state the tokens allowed after it are precomputed
once per tokenizer as one bitmask row in xgrammar's layout, so a step pays one AND per constrained row
(after a complete character, only over the words where that row has a zero bit).
Only tokens with a byte >= 0x80 need the automaton; an ASCII token is allowed exactly when nothing is
pending, and so is a stop or special token: no output may end in the middle of a character.
"""

from collections.abc import Sequence

import numpy as np
import torch

COMPLETE = 0
REJECT = 8
STATES = 8  # 0 complete; 1-3: 1-3 continuation bytes 80..BF to come; 4: after E0, 5: ED, 6: F0, 7: F4
_PAD = 256  # a padding column of the token byte matrix: leaves the state as it is

# the first continuation byte's range after each state, and the state it leads to
_CONTINUATIONS = {1: (0x80, 0xBF, COMPLETE), 2: (0x80, 0xBF, 1), 3: (0x80, 0xBF, 2), 4: (0xA0, 0xBF, 1),
                  5: (0x80, 0x9F, 1), 6: (0x90, 0xBF, 2), 7: (0x80, 0x8F, 2)}
_LEADS = [(0x00, 0x7F, COMPLETE), (0xC2, 0xDF, 1), (0xE0, 0xE0, 4), (0xE1, 0xEC, 2), (0xED, 0xED, 5),
          (0xEE, 0xEF, 2), (0xF0, 0xF0, 6), (0xF1, 0xF3, 3), (0xF4, 0xF4, 7)]


def _transitions() -> np.ndarray:
    """[STATES + 1, 257] uint8: the state after one byte (column 256: padding)."""
    table = np.full((STATES + 1, _PAD + 1), REJECT, dtype=np.uint8)
    for low, high, to in _LEADS:
        table[COMPLETE, low:high + 1] = to
    for state, (low, high, to) in _CONTINUATIONS.items():
        table[state, low:high + 1] = to
    table[:, _PAD] = np.arange(STATES + 1)
    return table


class Utf8Table:
    def __init__(self, token_bytes: Sequence[bytes], textless: Sequence[int], words: int) -> None:
        """``token_bytes``: each token's bytes as the grammar matches them; ``textless``: tokens that are no
        text (stop and special tokens), allowed only after a complete character; ``words``: int32 words of a
        mask row (ids past ``token_bytes`` are never allowed)."""
        vocab = len(token_bytes)
        ends = np.full((STATES, vocab), REJECT, dtype=np.uint8)
        ends[COMPLETE] = COMPLETE  # ASCII tokens; the others are overwritten below
        wide = [t for t, b in enumerate(token_bytes) if not b.isascii()]
        step = _transitions()
        if wide:
            length = max(len(token_bytes[t]) for t in wide)
            matrix = np.full((len(wide), length), _PAD, dtype=np.uint16)
            for row, t in enumerate(wide):
                data = token_bytes[t]
                matrix[row, :len(data)] = np.frombuffer(data, dtype=np.uint8)
            for start in range(STATES):
                state = np.full(len(wide), start, dtype=np.uint8)
                for column in matrix.T:
                    state = step[state, column]
                ends[start, wide] = state
        textless = [t for t in textless if 0 <= t < vocab]
        ends[:, textless] = REJECT
        ends[COMPLETE, textless] = COMPLETE
        self._next = [ends[s].tobytes() for s in range(STATES)]  # bytes: an int per index, fast from Python
        allowed = np.zeros((STATES, words * 32), dtype=bool)
        allowed[:, :vocab] = ends != REJECT
        packed = np.packbits(allowed, axis=1, bitorder="little")  # bit t % 8 of byte t // 8, as xgrammar's
        self.masks = packed.view("<i4")  # [STATES, words] int32
        # xgrammar never starts a character with a byte that cannot start one (80..BF, C0, C1, F5..FF), so
        # after a complete character the only tokens to take out are those that start like a character and
        # hide an invalid sequence further on (none in SmolLM2's vocabulary): the words holding them
        hidden = [t for t in wide if ends[COMPLETE, t] == REJECT and step[COMPLETE, token_bytes[t][0]] != REJECT]
        self._complete_words = np.unique(np.array(hidden, dtype=np.int64) // 32)

    def advance(self, state: int, token: int) -> int:
        """The state after ``token`` (REJECT when it makes the bytes invalid)."""
        return self._next[state][token]

    def after(self, state: int) -> np.ndarray:
        """[vocab] uint8: the state after each token."""
        return np.frombuffer(self._next[state], dtype=np.uint8)

    def restrict(self, mask: torch.Tensor, rows: list[int], states: list[int]) -> list[int]:
        """AND row ``rows[i]`` of the host mask with what may follow ``states[i]``, in place; returns the rows
        it took a token from (the only ones it can have left allowing nothing).

        Nearly every row of nearly every step follows a complete character and costs nothing more than
        ``any(states)`` (see ``_complete_words``); each numpy call counts, as right after xgrammar's fill the
        caches are cold and one costs 10-30 us of CPU."""
        narrowed = []
        if any(states):
            narrowed = [r for r, s in zip(rows, states, strict=True) if s != COMPLETE]
            mask.numpy()[narrowed] &= self.masks[[s for s in states if s != COMPLETE]]
        if self._complete_words.size:
            host, keep = mask.numpy(), self.masks[COMPLETE, self._complete_words]
            for row, state in zip(rows, states, strict=True):
                if state == COMPLETE and (host[row, self._complete_words] & ~keep).any():
                    host[row, self._complete_words] &= keep
                    narrowed.append(row)
        return narrowed

