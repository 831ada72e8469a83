"""A constraint that no valid UTF-8 text can meet (it spells a UTF-16 surrogate, U+D800..DFFF, which xgrammar
takes as the bytes ED A0 80 ...) does not compile, with a message naming ``structured_outputs.<kind>``, on the
real SmolLM2 tokenizer; constraints that only mention surrogates to exclude them, or spell a backslash and
a 'u', compile as before."""

import json

import pytest

from kvrelay.shared.engine.structured.backend import GrammarBackend
from kvrelay.shared.engine.structured.utf8_grammar import surrogate_literal
from kvrelay.shared.wire.structured_outputs import StructuredOutputs

SPELLS = r"it spells U\+D[89A-F][0-9A-F]{2}, a UTF-16 surrogate"
STARTS = "no valid UTF-8 text can start it"


@pytest.fixture(scope="module")
def backend(smollm2_dir):
    return GrammarBackend(str(smollm2_dir), [2])


def _pattern(regex: str) -> str:
    return json.dumps({"type": "object", "properties": {"code": {"type": "string", "pattern": regex}},
                       "required": ["code"]})


@pytest.mark.parametrize("so, why", [
    (StructuredOutputs(grammar=r'root ::= "\uD800"'), SPELLS),
    (StructuredOutputs(grammar=r'root ::= "a" "\uDBFF" "b"'), SPELLS),
    (StructuredOutputs(grammar=r'root ::= "b" | "\U0000D800"'), SPELLS),
    (StructuredOutputs(grammar=r'root ::= "\uD83D\uDE00"'), SPELLS),  # a surrogate pair: two surrogates to xgrammar
    (StructuredOutputs(grammar=r'root ::= [\uD800-\uDFFF]+ "a"'), STARTS),
    (StructuredOutputs(regex=r"\uD800"), SPELLS),
    (StructuredOutputs(regex=r"ab?\u{DC00}"), SPELLS),
    (StructuredOutputs(regex=r"[\uD800-\uDBFF][\uDC00-\uDFFF]"), STARTS),
    (StructuredOutputs(choice=["\ud800"]), SPELLS),
    (StructuredOutputs(json=_pattern(r"^[A-Z]\uD800$")), SPELLS),
], ids=["ebnf", "ebnf-later", "ebnf-alternative", "ebnf-pair", "ebnf-class", "regex", "regex-braces",
        "regex-classes", "choice", "json-pattern"])
def test_a_constraint_no_utf8_text_meets_does_not_compile(backend, so, why):
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{so.kind} does not compile: {why}"):
        backend.compile(so)


@pytest.mark.parametrize("so", [
    StructuredOutputs(grammar=r'root ::= [^\uD800-\uDFFF"]+'),
    StructuredOutputs(grammar=r'root ::= [\uD000-\uE000] "\\uD800" "😀" [😀-🙏]'),  # a backslash and a 'u'
    StructuredOutputs(grammar=r'root ::= "\U0001F600" [\u4e00-\u9fff]+'),
    StructuredOutputs(regex=r"[^\uD800-\uDFFF\n]{1,5}\\uD800"),
    StructuredOutputs(choice=["\\ud800", "x"]),
    StructuredOutputs(json=_pattern(r"^[^\uD800-\uDFFF]+$")),
    StructuredOutputs(json=json.dumps({"type": "object", "properties": {"\\ud800": {"const": '\\ud800 ["'}}})),
], ids=["negated-class", "mixed", "astral", "regex", "choice", "json-pattern", "json-text"])
def test_a_constraint_that_only_names_surrogates_compiles(backend, so):
    backend.compile(so)


def test_the_printed_grammar_is_read_as_literals_classes_and_kept_regexes():
    assert surrogate_literal(r'root ::= (("a" "\ud800"))') == 0xD800
    assert surrogate_literal(r'root ::= (([\ud800-\udfff] "\"\\ud800"))') is None  # a class; a backslash
    assert surrogate_literal(r'root ::= Regex("^[\\uD800]\\uDC01$", json_string=true)') == 0xDC01
    assert surrogate_literal(r'root ::= Regex("^[\\]\\uD800]\\\\uDC01$")') is None  # class holds "]"; "\\" then u
