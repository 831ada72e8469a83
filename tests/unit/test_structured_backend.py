"""The grammar backend (xgrammar) against the real SmolLM2 tokenizer: each constraint kind's mask allows
exactly the tokens that keep the output valid, and a constraint that does not compile is a ValueError
naming ``structured_outputs.<kind>``."""

import json

import pytest
import torch

from kvrelay.shared.engine.structured.backend import GrammarBackend
from kvrelay.shared.engine.structured.bitmask import allowed_ids, apply_token_bitmask, new_bitmask
from kvrelay.shared.text.tokenizer import load_tokenizer
from kvrelay.shared.wire.structured_outputs import StructuredOutputs

EOS = 2  # SmolLM2's <|endoftext|>, the engine's EOS for it


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def backend(smollm2_dir, tok):
    return GrammarBackend(str(smollm2_dir), [EOS])


def _allowed(backend, matcher, vocab: int) -> set[int]:
    mask = new_bitmask(1, backend.mask_words)
    matcher.fill_next_token_bitmask(mask, 0)
    return set(allowed_ids(mask[0], vocab))


@pytest.fixture(scope="module")
def texts(tok) -> list[str]:
    """Each token's text, decoded once."""
    return [tok.decode([t]) for t in range(len(tok))]


def _check_exact(backend, tok, texts, so: StructuredOutputs, walk: str, valid_prefix):
    """Walk ``walk`` token by token; at each step the mask must allow exactly the tokens whose text keeps a
    valid prefix (checked over the whole vocabulary, special tokens aside), and allow EOS only at the end."""
    matcher = backend.matcher(backend.compile(so), [EOS])
    vocab = backend.vocab_size
    special = set(tok.all_special_ids)
    tokens = tok.encode(walk, add_special_tokens=False)
    prefix = ""
    for step in range(len(tokens) + 1):
        allowed = _allowed(backend, matcher, vocab)
        assert not {t for t in allowed if t >= len(tok)}, "padding ids must never be allowed"
        expected = {t for t in range(len(tok)) if t not in special and valid_prefix(prefix + texts[t])}
        assert allowed - {EOS} == expected, f"after {prefix!r}"
        if step == len(tokens):
            assert EOS in allowed
            break
        assert EOS not in allowed or valid_prefix(prefix + "\0end")
        assert matcher.accept_token(tokens[step])
        prefix += tok.decode([tokens[step]])


def test_choice_allows_exactly_the_prefixes_of_the_choices(backend, tok, texts):
    choices = ["positive", "negative", 'say "hi"']

    def valid(text: str) -> bool:
        if text.endswith("\0end"):
            return text[:-4] in choices
        return bool(text) and any(c.startswith(text) for c in choices)

    for walk in choices:
        _check_exact(backend, tok, texts, StructuredOutputs(choice=choices), walk, valid)


def test_regex_allows_exactly_the_matching_prefixes(backend, tok, texts):
    import re

    pattern = r"[0-9]{2,3}-(ab|cd)"
    nums = [f"{i:02d}" for i in range(100)] + [f"{i:03d}" for i in range(1000)]
    language = [n + "-" + s for n in nums for s in ("ab", "cd")]
    prefixes = {m[:i] for m in language for i in range(1, len(m) + 1)}

    def valid(text: str) -> bool:
        if text.endswith("\0end"):
            return re.fullmatch(pattern, text[:-4]) is not None
        return text in prefixes

    _check_exact(backend, tok, texts, StructuredOutputs(regex=pattern), "417-cd", valid)


def test_json_schema_mask_keeps_every_step_a_prefix_of_a_valid_document(backend, tok):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "b"]}},
              "required": ["ok", "kind"], "additionalProperties": False}
    so = StructuredOutputs(json=json.dumps(schema))
    matcher = backend.matcher(backend.compile(so), [EOS])
    text = '{"ok": true, "kind": "b"}'
    prefix = ""
    # every valid document of this schema in the backend's layout (compact separators with one space)
    docs = [f'{{"ok": {b}, "kind": "{k}"}}' for b in ("true", "false") for k in ("a", "b")]
    for token in tok.encode(text, add_special_tokens=False):
        allowed = _allowed(backend, matcher, backend.vocab_size)
        for t in allowed:
            assert any(d.startswith(prefix + tok.decode([t])) for d in docs), repr(prefix + tok.decode([t]))
        assert token in allowed and EOS not in allowed
        assert matcher.accept_token(token)
        prefix += tok.decode([token])
    assert _allowed(backend, matcher, backend.vocab_size) == {EOS}  # complete: only the end may follow
    assert matcher.is_completed()


def test_json_object_and_grammar_compile_and_constrain(backend, tok):
    m = backend.matcher(backend.compile(StructuredOutputs(json_object=True)), [EOS])
    first = _allowed(backend, m, backend.vocab_size)
    assert first and all(tok.decode([t]).lstrip().startswith("{") for t in first)
    g = backend.matcher(backend.compile(StructuredOutputs(grammar='root ::= ("ab" | "c") [0-9]')), [EOS])
    first = {tok.decode([t]) for t in _allowed(backend, g, backend.vocab_size)}
    assert first and all(s in ("a", "ab", "c") or s.startswith(("ab", "c")) and s[len(s) - 1].isdigit()
                         for s in first), first


@pytest.mark.parametrize("so, kind", [
    (StructuredOutputs(json='{"type": "nope"}'), "json"),
    (StructuredOutputs(json="{not json"), "json"),
    (StructuredOutputs(regex="(["), "regex"),
    (StructuredOutputs(grammar="root ::= undefined_rule"), "grammar"),
])
def test_a_constraint_that_does_not_compile_names_its_field(backend, so, kind):
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{kind} does not compile: \S"):
        backend.compile(so)


def test_apply_token_bitmask_touches_only_the_constrained_rows():
    vocab = 70  # not a multiple of 32: the last word's high bits lie past the vocabulary
    logits = torch.randn(3, vocab)
    mask = new_bitmask(1, 3)
    for t in (0, 31, 32, 69):
        mask[0, t // 32] |= torch.tensor(1 << t % 32, dtype=torch.int64).to(torch.int32)
    out = apply_token_bitmask(logits, torch.tensor([1]), mask)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    finite = out[1].isfinite().nonzero().flatten().tolist()
    assert finite == [0, 31, 32, 69]
    assert torch.equal(out[1, finite], logits[1, finite])


def test_an_object_never_gains_a_property_its_schema_leaves_unstated(backend, texts):
    """No additionalProperties in the schema: after the listed properties only the object's end may follow
    (what vLLM's disable_additional_properties asks for)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
    matcher = backend.matcher(backend.compile(StructuredOutputs(json=json.dumps(schema))), [EOS])
    assert matcher.accept_string('{"a": 1')
    after_a = {texts[t] for t in _allowed(backend, matcher, backend.vocab_size)}
    assert any(t.startswith(",") for t in after_a) and any(t.startswith("}") for t in after_a)
    assert matcher.accept_string(', "')
    keys = {texts[t] for t in _allowed(backend, matcher, backend.vocab_size)}
    assert keys and all("b".startswith(k) or k.startswith('b"') for k in keys), sorted(keys)[:20]
    assert matcher.accept_string('b": "x"')
    assert {texts[t][:1] for t in _allowed(backend, matcher, backend.vocab_size)} == {"}"}


def test_model_rows_past_the_mask_are_forbidden():
    """A mask as wide as the tokenizer's vocabulary over a model with more rows (padded embeddings): the rows
    past the mask get -inf, whatever the mask's last word says."""
    vocab = 100  # the mask's 2 words cover tokens 0..63
    logits = torch.randn(2, vocab)
    mask = torch.full((1, 2), -1, dtype=torch.int32)  # every covered token allowed
    out = apply_token_bitmask(logits, torch.tensor([0]), mask)
    assert torch.equal(out[0, :64], logits[0, :64]) and out[0, 64:].eq(float("-inf")).all()
    assert torch.equal(out[1], logits[1])


def test_the_backend_vocabulary_is_the_tokenizers(backend, tok):
    assert backend.vocab_size == len(tok) and backend.mask_words == (len(tok) + 31) // 32


@pytest.mark.parametrize("bounds", [{"maxLength": 5}, {"minLength": 2}, {"minLength": 1, "maxLength": 3}])
def test_length_bounded_strings_never_allow_a_raw_control_character(backend, tok, texts, bounds):
    # JSON forbids raw control characters in strings (json.loads and JSON.parse refuse them); xgrammar's own
    # length-bounded strings let them through, so the backend writes the bounds as a pattern
    schema = {"type": "object", "properties": {"s": {"type": "string", **bounds}}, "required": ["s"],
              "additionalProperties": False}
    matcher = backend.matcher(backend.compile(StructuredOutputs(json=json.dumps(schema))), [EOS])
    assert matcher.accept_string('{"s": "a')
    allowed = _allowed(backend, matcher, backend.vocab_size)
    assert allowed and not [t for t in allowed if any(ord(ch) < 0x20 for ch in texts[t])]
    low, high = bounds.get("minLength", 0), bounds.get("maxLength", 100)
    for n in range(0, 12):
        m = backend.matcher(backend.compile(StructuredOutputs(json=json.dumps(schema))), [EOS])
        text = '{"s": "' + "x" * n + '"}'
        assert (m.accept_string(text) and m.is_completed()) == (low <= n <= high), n
