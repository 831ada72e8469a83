"""Grammar backends for structured outputs, measured side by side on the SmolLM2 tokenizer (49152 tokens):
xgrammar, llguidance and outlines-core.

Per backend:
- tokenizer setup (once per model) and compile time of a 10-field JSON-object schema (cold: no cache);
- the per-step CPU cost at batch 64: fill a [64, ceil(V/32)] int32 token bitmask for 64 matchers and
  advance each by one token, walking a valid JSON instance of the schema (what the engine does each
  decode step), on one thread, and with the backend's own parallel batch fill where it has one;
- coverage: for a set of schemas (nested objects, arrays, enums, anyOf, $ref, patterns, min/maxItems)
  and for regex / choice / EBNF, whether it compiles, accepts a valid output token by token (ending
  where EOS is allowed) and rejects an invalid one.

Run: ``.venv/bin/python bench/grammar_backends.py [--steps-repeat N]``; results go into BENCHMARKS.md.
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from kvrelay.shared.repo.model_source import resolve_model
from kvrelay.shared.text.tokenizer import load_tokenizer

BATCH = 64

SCHEMA10 = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "email": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "note": {"type": ["string", "null"]},
    },
    "required": ["id", "name", "email", "age", "score", "active", "role", "tags", "address", "note"],
    "additionalProperties": False,
}
INSTANCE10 = {"id": 42, "name": "Ada Lovelace", "email": "ada@example.com", "age": 36, "score": 97.5,
              "active": True, "role": "admin", "tags": ["math", "engines", "poetry"],
              "address": {"city": "London", "zip": "W1"}, "note": None}

# (name, schema, valid instance, invalid instance)
COVERAGE = [
    ("nested objects", {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "integer"}}, "required": ["c"]}}, "required": ["b"]}},
        "required": ["a"], "additionalProperties": False}, {"a": {"b": {"c": 1}}}, {"a": {"b": {"c": "x"}}}),
    ("arrays of objects", {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"}},
                                                      "required": ["x"]}}, [{"x": 1.5}, {"x": 2}], [{"y": 1}]),
    ("enum", {"type": "object", "properties": {"c": {"enum": ["red", "green", 3]}}, "required": ["c"],
              "additionalProperties": False}, {"c": "green"}, {"c": "blue"}),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"k": {"type": "string"}},
                                                "required": ["k"], "additionalProperties": False}]},
     {"k": "v"}, [1]),
    ("$ref/$defs", {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                                     "additionalProperties": False}},
                    "type": "object", "properties": {"p": {"$ref": "#/$defs/pt"}}, "required": ["p"],
                    "additionalProperties": False}, {"p": {"x": 3}}, {"p": {"y": 3}}),
    ("string pattern", {"type": "object", "properties": {"d": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}$"}},
                        "required": ["d"], "additionalProperties": False}, {"d": "2026-12"}, {"d": "26-12"}),
    ("min/maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
     [1, 2, 3], [1, 2, 3, 4]),
    ("string min/maxLength", {"type": "string", "minLength": 2, "maxLength": 4}, "abc", "abcdef"),
    ("recursive $ref", {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
                                                                            "next": {"anyOf": [{"$ref": "#/$defs/node"},
                                                                                               {"type": "null"}]}},
                                           "required": ["v", "next"], "additionalProperties": False}},
                        "$ref": "#/$defs/node"}, {"v": 1, "next": {"v": 2, "next": None}}, {"v": 1, "next": 3}),
]
REGEX = (r"\d{3}-[a-z]+", "123-abc", "12-abc")
CHOICE = (["positive", "negative", "neutral"], "neutral", "neutralish")
# GBNF-style EBNF (what vLLM's guided_grammar takes with xgrammar); llguidance takes Lark (converted)
EBNF = ('root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9]+', "12+3+45", "12++3")


def _bytes_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character each byte is written as in the vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


# -- one adapter per backend: setup(tok) -> compile(kind, text) -> new matcher(), accept, fill -------------
class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, eos: int, threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, kind: str, text):
        c = self.compiler
        if kind == "json":
            return c.compile_json_schema(text, any_whitespace=False, separators=(",", ":"))
        if kind == "regex":
            return c.compile_regex(text)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in text))
        return c.compile_grammar(text)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def fill(self, matchers, bitmask: np.ndarray, parallel: bool) -> None:
        import torch

        t = torch.from_numpy(bitmask)
        if parallel:
            self.batch.batch_fill_next_token_bitmask(matchers, t)
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(t, i)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, eos: int, threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.ll, self.np = llguidance, llguidance.numpy
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=eos)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, kind: str, text):
        M = self.ll.LLMatcher
        if kind == "json":
            grammar = M.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
        elif kind == "regex":
            grammar = M.grammar_from_regex(text)
        elif kind == "choice":
            grammar = M.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in text))
        else:
            from llguidance.gbnf_to_lark import any_to_lark

            grammar = M.grammar_from_lark(any_to_lark(text))
        err = M.validate_grammar(grammar, self.tok)
        if err:
            raise ValueError(err)
        return grammar

    def matcher(self, compiled):
        m = self.ll.LLMatcher(self.tok, compiled, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token) and not m.is_error()

    def fill(self, matchers, bitmask: np.ndarray, parallel: bool) -> None:
        if parallel:
            self.np.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        else:
            for i, m in enumerate(matchers):
                self.np.fill_next_token_bitmask(m, bitmask, i)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok, eos: int, threads: int) -> None:
        import outlines_core

        self.oc = outlines_core
        decode = _bytes_decoder()
        by_bytes: dict[bytes, list[int]] = {}
        special = set(tok.all_special_ids)
        for token, i in tok.get_vocab().items():
            if i in special:
                continue
            by_bytes.setdefault(bytes(decode[ch] for ch in token), []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, by_bytes)

    def compile(self, kind: str, text):
        import re

        from outlines_core.json_schema import build_regex_from_schema

        if kind == "json":
            regex = build_regex_from_schema(text)
        elif kind == "regex":
            regex = text
        elif kind == "choice":
            regex = "|".join(re.escape(s) for s in text)
        else:
            raise ValueError("outlines-core has no context-free grammars")
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def accept(self, m, token: int) -> bool:
        try:
            m.advance(token, return_tokens=False)
            return True
        except Exception:
            return False

    def fill(self, matchers, bitmask: np.ndarray, parallel: bool) -> None:
        words = bitmask.shape[1]
        for i, m in enumerate(matchers):
            row = bitmask[i]
            m.write_mask_into(row.ctypes.data, words, 4)


BACKENDS: list[Callable] = [XGrammar, LLGuidance, OutlinesCore]


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


def _allowed(bitmask_row: np.ndarray, token: int) -> bool:
    return bool((int(bitmask_row[token // 32]) >> (token % 32)) & 1)


def _walk(backend, compiled, tokens: list[int], eos: int, words: int) -> bool:
    """Whether the backend allows every token of ``tokens`` in turn, then EOS."""
    m = backend.matcher(compiled)
    bitmask = np.zeros((1, words), dtype=np.int32)
    for tok in [*tokens, eos]:
        bitmask[:] = 0
        backend.fill([m], bitmask, False)
        if not _allowed(bitmask[0], tok):
            return False
        if tok != eos and not backend.accept(m, tok):
            return False
    return True


def step_cost(backend, compiled, tokens: list[int], eos: int, words: int, parallel: bool) -> tuple[float, float]:
    """Mean (fill, accept) seconds per step for BATCH matchers walking ``tokens``."""
    matchers = [backend.matcher(compiled) for _ in range(BATCH)]
    bitmask = np.zeros((BATCH, words), dtype=np.int32)
    fills, accepts = [], []
    for tok in tokens:
        t_fill, _ = _timed(lambda: backend.fill(matchers, bitmask, parallel))
        if not _allowed(bitmask[0], tok):
            raise AssertionError(f"{backend.name} refused a valid token {tok}")
        t_acc, _ = _timed(lambda tok=tok: [backend.accept(m, tok) for m in matchers])
        fills.append(t_fill)
        accepts.append(t_acc)
    return statistics.mean(fills), statistics.mean(accepts)


def coverage(backend, tok, eos: int, words: int) -> dict[str, str]:
    dump = lambda v: json.dumps(v, separators=(",", ":"))  # noqa: E731 - compact, as the compilers are set up
    cases = [(n, "json", json.dumps(s), dump(v), dump(bad)) for n, s, v, bad in COVERAGE]
    cases += [("regex", "regex", REGEX[0], REGEX[1], REGEX[2]),
              ("choice", "choice", CHOICE[0], CHOICE[1], CHOICE[2]),
              ("EBNF grammar", "grammar", EBNF[0], EBNF[1], EBNF[2])]
    results = {}
    for name, kind, text, good, bad in cases:
        try:
            compiled = backend.compile(kind, text)
        except Exception as exc:  # noqa: BLE001 - any failure to compile is "unsupported" here
            results[name] = f"no ({type(exc).__name__})"
            continue
        enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
        ok_good = _walk(backend, compiled, enc(good), eos, words)
        ok_bad = not _walk(backend, compiled, enc(bad), eos, words)
        results[name] = "yes" if ok_good and ok_bad else f"wrong (valid {'ok' if ok_good else 'refused'}, " \
                                                         f"invalid {'refused' if ok_bad else 'accepted'})"
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="threads for the parallel batch fill and compilers")
    p.add_argument("--compile-repeats", type=int, default=3)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: SmolLM2's)")
    args = p.parse_args()
    tok = load_tokenizer(args.tokenizer or resolve_model("smollm2").path)
    eos = tok.eos_token_id
    words = (len(tok) + 31) // 32
    schema = json.dumps(SCHEMA10)
    tokens = tok.encode(json.dumps(INSTANCE10, separators=(",", ":")), add_special_tokens=False)
    print(f"SmolLM2 tokenizer: {len(tok)} tokens; 10-field instance: {len(tokens)} tokens; batch {BATCH}")
    for cls in BACKENDS:
        t_setup, backend = _timed(lambda cls=cls: cls(tok, eos, args.threads))
        compiles = []
        for _ in range(args.compile_repeats):
            t, compiled = _timed(lambda b=backend: b.compile("json", schema))
            # llguidance builds its lexer lazily in the matcher: count the first matcher as compile time
            t_first, _ = _timed(lambda b=backend, c=compiled: b.matcher(c))
            compiles.append(t + t_first)
        fill1, acc1 = step_cost(backend, compiled, tokens, eos, words, parallel=False)
        fillp, accp = step_cost(backend, compiled, tokens, eos, words, parallel=True)
        print(f"\n== {backend.name}: tokenizer setup {t_setup * 1e3:.0f} ms; compile 10-field schema "
              f"{statistics.median(compiles) * 1e3:.1f} ms (median of {len(compiles)})")
        print(f"   batch-{BATCH} step, 1 thread: fill {fill1 * 1e6:.0f} us + accept {acc1 * 1e6:.0f} us "
              f"= {(fill1 + acc1) * 1e6:.0f} us ({(fill1 + acc1) / BATCH * 1e6:.1f} us/row)")
        print(f"   batch-{BATCH} step, parallel fill ({args.threads} threads): fill {fillp * 1e6:.0f} us + "
              f"accept {accp * 1e6:.0f} us = {(fillp + accp) * 1e6:.0f} us")
        for name, verdict in coverage(backend, tok, eos, words).items():
            print(f"   {name:22s} {verdict}")


if __name__ == "__main__":
    main()
