"""Grammars that no valid UTF-8 text can meet, found when they compile rather than when a request ends with
a stop token and a U+FFFD (utf8.py masks the surrogates xgrammar would spell, leaving such a sequence no token).

xgrammar takes ``\\uD800`` in an EBNF literal or a regex (and ``\\uD83D\\uDE00``, a UTF-16 surrogate pair, as
two surrogates) as bytes ED A0 80, which RFC 3629 forbids. Two checks, both on the compiled grammar, so every
kind is covered alike (a JSON schema's ``pattern`` too):
- ``surrogate_literal``: xgrammar's printed grammar (literals, and the regexes it keeps as ``Regex("...")``) names
  a surrogate outside a character class. Such a literal can never be spelled; it is refused even in an
  alternative another branch of which could be met, as writing it is the client's mistake either way;
- ``starts_validly``: from the grammar's first state some token completes a valid character or ends the
  output; this catches a character class of surrogates only, at the start (``[\\uD800-\\uDFFF]+``).
What neither catches, a class of surrogates only past the start (``"a" [\\uD800-\\uDBFF]``), still ends the
sequence at that point with its stop token (manager.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from kvrelay.shared.engine.structured.utf8 import COMPLETE, REJECT, Utf8Table

# xgrammar's printed grammar: a kept regex, a string literal, a character class, anything else
_PRINTED = re.compile(r'Regex\("((?:[^"\\]|\\.)*)"|"((?:[^"\\]|\\.)*)"|\[(?:[^\]\\]|\\.)*\]|[^"\[R]+|.', re.S)
# a regex's character class (its first ] is a member), an escape, anything else
_REGEX = re.compile(r"\[\^?\]?(?:[^\]\\]|\\.)*\]|(\\(?:u\{[0-9a-fA-F]+\}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.))|.", re.S)
_ESCAPE = re.compile(r"\\(?:u\{([0-9a-fA-F]+)\}|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|x([0-9a-fA-F]{2})|(.))", re.S)
_PLAIN = {"n": "\n", "r": "\r", "t": "\t"}
SEARCH_BUDGET = 64  # matcher states tried before giving up (and accepting the grammar)


def _code(escape: re.Match) -> int | None:
    digits = next((g for g in escape.groups()[:4] if g), None)
    return int(digits, 16) if digits else None


def _unescape(literal: str) -> str:
    """A printed literal's text (the escapes xgrammar's printer writes)."""
    def one(m: re.Match) -> str:
        code = _code(m)
        return chr(code) if code is not None else _PLAIN.get(m.group(5), m.group(5))
    return _ESCAPE.sub(one, literal)


def _is_surrogate(code: int) -> bool:
    return 0xD800 <= code <= 0xDFFF


def _regex_surrogate(regex: str) -> int | None:
    for token in _REGEX.finditer(regex):
        if token.group(1):
            code = _code(_ESCAPE.fullmatch(token.group(1)))
            if code is not None and _is_surrogate(code):
                return code
        elif len(token.group(0)) == 1 and _is_surrogate(ord(token.group(0))):
            return ord(token.group(0))
    return None


def surrogate_literal(printed: str) -> int | None:
    """The first surrogate code point ``printed`` (``str`` of an xgrammar Grammar) spells outside a character
    class, or None."""
    for token in _PRINTED.finditer(printed):
        regex, literal = token.group(1), token.group(2)
        if regex is not None:
            found = _regex_surrogate(_unescape(regex))
            if found is not None:
                return found
        elif literal is not None:
            found = next((ord(ch) for ch in _unescape(literal) if _is_surrogate(ord(ch))), None)
            if found is not None:
                return found
    return None


def starts_validly(matcher, utf8: Utf8Table, allowed: Callable[[object], np.ndarray], stops: list[int]) -> bool:
    """Whether from ``matcher``'s state some tokens complete a valid character or a stop ends the output;
    ``allowed(matcher)``: which token ids its mask allows, [vocab] bool. True too when the search runs past
    its budget."""
    budget = [SEARCH_BUDGET]

    def search(state: int) -> bool:
        budget[0] -= 1
        text = allowed(matcher)
        if state == COMPLETE and text[stops].any():
            return True
        text[stops] = False
        after = utf8.after(state)
        if (text & (after == COMPLETE)).any():
            return True
        for token in np.flatnonzero(text & (after != REJECT)).tolist():
            if budget[0] <= 0:
                return True
            if not matcher.accept_token(token):  # the mask allowed it: never, but a rollback needs it taken
                continue
            found = search(int(after[token]))
            matcher.rollback(1)
            if found:
                return True
        return False

    return search(COMPLETE)
