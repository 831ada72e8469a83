"""The grammar backend: xgrammar, bound to one model's tokenizer.

Why xgrammar (bench/grammar_backends.py, BENCHMARKS.md): on the SmolLM2 tokenizer it fills a batch-64
token bitmask in about a quarter of llguidance's time and an eighth of outlines-core's, compiles a
10-field schema in milliseconds, covers every schema feature measured, and takes regex and EBNF directly.

The tokenizer info is built once per engine (seconds on a 128k vocabulary, so it runs on the compile
thread, never on the step loop). Its vocabulary is the tokenizer's own, not the model's: the model's rows
past it (a checkpoint's padded embedding rows, or a dummy model's larger vocabulary) are never allowed by
any grammar, and the mask applies that itself (bitmask.py) instead of xgrammar filling bits for them —
declaring 79k unknown ids to xgrammar made every fill ~10x slower (a 49,152-token tokenizer under a
128,256-row model). The mask's bits past the model's vocabulary are never read.

xgrammar lets some invalid UTF-8 through (utf8.py): ``utf8`` holds which tokens keep an output valid after
each partial character, built here once per tokenizer (milliseconds: only non-ASCII tokens are walked).
Special tokens are never text under any grammar; only a stop token ends one (tokenizer_info.py). A grammar
that spells a UTF-16 surrogate, which the UTF-8 mask would leave no token, does not compile (utf8_grammar.py).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

import numpy as np

from kvrelay.shared.engine.structured.bitmask import new_bitmask
from kvrelay.shared.engine.structured.json_strings import strict_counted_strings
from kvrelay.shared.engine.structured.tokenizer_info import tokenizer_info
from kvrelay.shared.engine.structured.utf8 import Utf8Table
from kvrelay.shared.engine.structured.utf8_grammar import starts_validly, surrogate_class, surrogate_literal
from kvrelay.shared.wire.structured_outputs import StructuredOutputs

if TYPE_CHECKING:
    import xgrammar


class GrammarBackend:
    def __init__(self, tokenizer_dir: str, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        from kvrelay.shared.text.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_dir)
        self.vocab_size = max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)
        stops = [t for t in stop_token_ids if 0 <= t < self.vocab_size]
        if not stops and tokenizer.eos_token_id is not None:
            stops = [tokenizer.eos_token_id]
        self.info = tokenizer_info(tokenizer, self.vocab_size, stops or None)
        # one compile at a time per engine: the pool that calls this has one thread (compile_cache.py)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.utf8 = Utf8Table([bytes(b) for b in self.info.decoded_vocab],
                              [*self.info.special_token_ids, *self.info.stop_token_ids], self.mask_words)
        self._xgr = xgr

    @property
    def mask_words(self) -> int:
        """int32 words of one row of the token bitmask."""
        return (self.vocab_size + 31) // 32

    def compile(self, so: StructuredOutputs) -> xgrammar.CompiledGrammar:
        """Compile one constraint; ValueError naming ``structured_outputs.<kind>`` when it does not."""
        kind = so.kind
        try:
            compiled = self._compile(so)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/its own errors
            raise ValueError(f"structured_outputs.{kind} does not compile: {_reason(exc)}") from None
        why = self._not_utf8(compiled)
        if why:
            raise ValueError(f"structured_outputs.{kind} does not compile: {why}")
        return compiled

    def _compile(self, so: StructuredOutputs) -> xgrammar.CompiledGrammar:
        kind, c = so.kind, self.compiler
        if kind == "json":
            # compact separators and no free whitespace: a small model given free whitespace can emit
            # newlines until max_tokens (vLLM's --disable-any-whitespace)
            return c.compile_json_schema(strict_counted_strings(so.json), any_whitespace=False)
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return c.compile_regex(so.regex)
        if kind == "choice":
            return c.compile_grammar(choice_grammar(so.choice))
        return c.compile_grammar(so.grammar)

    def _not_utf8(self, compiled: xgrammar.CompiledGrammar) -> str:
        """Why no valid UTF-8 text meets ``compiled`` (utf8_grammar.py); empty when some may."""
        code = surrogate_literal(str(compiled.grammar))
        if code is not None:
            return (f"it spells U+{code:04X}, a UTF-16 surrogate, which no UTF-8 text holds (write a character "
                    "past U+FFFF as itself, not as the escapes of its UTF-16 surrogate pair)")
        code = surrogate_class(str(compiled.grammar))
        if code is not None:
            return (f"a character class of UTF-16 surrogates only (from U+{code:04X}) matches no UTF-8 text (name "
                    "a character past U+FFFF as itself, not as a range of surrogates)")
        matcher = self.matcher(compiled)
        if not starts_validly(matcher, self.utf8, self._allowed, self.info.stop_token_ids):
            return "no valid UTF-8 text can start it (it begins with a UTF-16 surrogate, U+D800..DFFF)"
        return ""

    def _allowed(self, matcher: xgrammar.GrammarMatcher) -> np.ndarray:
        """[vocab] bool: the tokens ``matcher``'s mask allows next."""
        mask = new_bitmask(1, self.mask_words)
        matcher.fill_next_token_bitmask(mask, 0)
        return np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)

    def batch_matcher(self, threads: int) -> xgrammar.BatchGrammarMatcher:
        """Fills many matchers' mask rows in one call, over ``threads`` host threads."""
        return self._xgr.BatchGrammarMatcher(max_threads=threads)

    def matcher(self, compiled: xgrammar.CompiledGrammar, stop_token_ids: list[int] | None = None
                ) -> xgrammar.GrammarMatcher:
        """A fresh matcher; ``stop_token_ids`` end the output once the grammar is complete (default: the
        tokenizer info's)."""
        stops = [t for t in stop_token_ids or () if 0 <= t < self.vocab_size] or None
        return self._xgr.GrammarMatcher(compiled, override_stop_tokens=stops)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices``: each a string literal (JSON escaping is what
    xgrammar's EBNF literals take: \\", \\\\, \\n, \\uXXXX)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ log prefix ("[time] file.cc:line: Check failed: ... is false: ")."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", text)
    text = re.sub(r"^Check failed: .*? is false: ", "", text)
    return text[:500]

