"""Grammars that no valid UTF-8 text can meet, found when they compile rather than when a request ends with
a stop token and a U+FFFD (utf8.py masks the surrogates xgrammar would spell, leaving such a sequence no token).

xgrammar takes ``\\uD800`` in an EBNF literal or a regex (and ``\\uD83D\\uDE00``, a UTF-16 surrogate pair, as
two surrogates) as bytes ED A0 80, which RFC 3629 forbids. Three checks, all on the compiled grammar, so every
kind is covered alike (a JSON schema's ``pattern`` too):
- ``surrogate_literal``: xgrammar's printed grammar (literals, and the regexes it keeps as ``Regex("...")``) names
  a surrogate outside a character class. Such a literal can never be spelled; it is refused even in an
  alternative another branch of which could be met, as writing it is the client's mistake either way;
- ``surrogate_class``: the printed grammar (or a kept regex) has a character class, not negated, whose every
  member is a surrogate (``"a" [\\uD800-\\uDBFF]``): nothing can match it, wherever it stands;
- ``starts_validly``: from the grammar's first state some token completes a valid character or ends the
  output; a search over the real vocabulary, for whatever the printed form hides from the two scans above.
What none catches (a surrogate-only set xgrammar prints in another form, past the start) still ends the
sequence at that point with its stop token (manager.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from kvrelay.shared.engine.structured.utf8 import COMPLETE, REJECT, Utf8Table

# xgrammar's printed grammar: a kept regex, a string literal, a character class, anything else
_PRINTED = re.compile(r'Regex\("((?:[^"\\]|\\.)*)"|"((?:[^"\\]|\\.)*)"|\[((?:[^\]\\]|\\.)*)\]|[^"\[R]+|.', re.S)
# a regex's character class (its first ] is a member), an escape, anything else
_REGEX = re.compile(r"(\[\^?\]?(?:[^\]\\]|\\.)*\])|(\\(?:u\{[0-9a-fA-F]+\}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.))|.", re.S)
_ESCAPE = re.compile(r"\\(?:u\{([0-9a-fA-F]+)\}|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|x([0-9a-fA-F]{2})|(.))", re.S)
_PLAIN = {"n": "\n", "r": "\r", "t": "\t"}
# one member of a class's body: an escape (\d and its kind stand for no surrogate) or a character
_MEMBER = re.compile(r"\\(?:u\{[0-9a-fA-F]+\}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|x[0-9a-fA-F]{2}|.)|.", re.S)
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
            continue
        if token.group(2):
            code = _code(_ESCAPE.fullmatch(token.group(2)))
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


def _member_code(member: str) -> int:
    escape = _ESCAPE.fullmatch(member) if member.startswith("\\") else None
    code = _code(escape) if escape else None
    return code if code is not None else ord(member[-1])


def _class_surrogate(body: str) -> int | None:
    """The lowest member of a character class (``body``: between its brackets) if every member is a surrogate;
    None when the class is negated or holds anything else, as it can then match."""
    if body.startswith("^"):
        return None
    members = _MEMBER.findall(body)
    ranges, i = [], 0
    while i < len(members):
        lo = _member_code(members[i])
        if i + 2 < len(members) and members[i + 1] == "-":
            ranges.append((lo, _member_code(members[i + 2])))
            i += 3
        else:
            ranges.append((lo, lo))
            i += 1
    if ranges and all(_is_surrogate(lo) and _is_surrogate(hi) for lo, hi in ranges):
        return min(lo for lo, _ in ranges)
    return None


def surrogate_class(printed: str) -> int | None:
    """The lowest member of the first character class in ``printed`` (``str`` of an xgrammar Grammar, kept
    regexes included) that holds surrogates only, or None."""
    for token in _PRINTED.finditer(printed):
        regex, body = token.group(1), token.group(3)
        if body is not None:
            found = _class_surrogate(body)
        elif regex is not None:
            found = next((code for cls in _REGEX.finditer(_unescape(regex)) if cls.group(1)
                          for code in [_class_surrogate(cls.group(1)[1:-1])] if code is not None), None)
        else:
            continue
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
