"""A constraint that no valid UTF-8 text can meet (it spells a UTF-16 surrogate, U+D800..DFFF, which xgrammar
takes as the bytes ED A0 80 ...) does not compile, with a message naming ``structured_outputs.<kind>``, on the
real SmolLM2 tokenizer; constraints that only mention surrogates to exclude them, or spell a backslash and
a 'u', compile as before."""

import json

import pytest

from kvrelay.shared.engine.structured.backend import GrammarBackend
from kvrelay.shared.engine.structured.utf8_grammar import starts_validly, surrogate_class, surrogate_literal
from kvrelay.shared.wire.structured_outputs import StructuredOutputs

SPELLS = r"it spells U\+D[89A-F][0-9A-F]{2}, a UTF-16 surrogate"
CLASS = r"a character class of UTF-16 surrogates only \(from U\+D[89A-F][0-9A-F]{2}\)"


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
    (StructuredOutputs(grammar=r'root ::= [\uD800-\uDFFF]+ "a"'), CLASS),
    (StructuredOutputs(grammar=r'root ::= "a" [\uD800-\uDBFF]'), CLASS),
    (StructuredOutputs(grammar=r'root ::= "a" ([\uDC00\uD800] | "b")'), CLASS),
    (StructuredOutputs(regex=r"\uD800"), SPELLS),
    (StructuredOutputs(regex=r"ab?\u{DC00}"), SPELLS),
    (StructuredOutputs(regex=r"[\uD800-\uDBFF][\uDC00-\uDFFF]"), CLASS),
    (StructuredOutputs(regex=r"ab+[\uDC00-\uDFFF]?"), CLASS),
    (StructuredOutputs(choice=["\ud800"]), SPELLS),
    (StructuredOutputs(json=_pattern(r"^[A-Z]\uD800$")), SPELLS),
    (StructuredOutputs(json=_pattern(r"^[A-Z][\uD800-\uDFFF]$")), CLASS),
], ids=["ebnf", "ebnf-later", "ebnf-alternative", "ebnf-pair", "ebnf-class", "ebnf-class-later",
        "ebnf-class-alternative", "regex", "regex-braces", "regex-classes", "regex-class-later", "choice",
        "json-pattern", "json-pattern-class"])
def test_a_constraint_no_utf8_text_meets_does_not_compile(backend, so, why):
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{so.kind} does not compile: {why}"):
        backend.compile(so)


@pytest.mark.parametrize("so", [
    StructuredOutputs(grammar=r'root ::= [^\uD800-\uDFFF"]+'),
    StructuredOutputs(grammar=r'root ::= [\uD000-\uE000] "\\uD800" "😀" [😀-🙏]'),  # a backslash and a 'u'
    StructuredOutputs(grammar=r'root ::= "\U0001F600" [\u4e00-\u9fff]+'),
    StructuredOutputs(regex=r"[^\uD800-\uDFFF\n]{1,5}\\uD800"),
    StructuredOutputs(regex=r"a[\uDC00-\uDFFF\d-]"),
    StructuredOutputs(choice=["\\ud800", "x"]),
    StructuredOutputs(json=_pattern(r"^[^\uD800-\uDFFF]+$")),
    StructuredOutputs(json=json.dumps({"type": "object", "properties": {"\\ud800": {"const": '\\ud800 ["'}}})),
], ids=["negated-class", "mixed", "astral", "regex", "regex-class-mixed", "choice", "json-pattern", "json-text"])
def test_a_constraint_that_only_names_surrogates_compiles(backend, so):
    backend.compile(so)


def test_the_printed_grammar_is_read_as_literals_classes_and_kept_regexes():
    assert surrogate_literal(r'root ::= (("a" "\ud800"))') == 0xD800
    assert surrogate_literal(r'root ::= (([\ud800-\udfff] "\"\\ud800"))') is None  # a class; a backslash
    assert surrogate_literal(r'root ::= Regex("^[\\uD800]\\uDC01$", json_string=true)') == 0xDC01
    assert surrogate_literal(r'root ::= Regex("^[\\]\\uD800]\\\\uDC01$")') is None  # class holds "]"; "\\" then u


def test_a_class_counts_as_surrogates_only_when_every_member_is_one():
    assert surrogate_class(r'root ::= (("a" [\udc00\ud800-\udbff]))') == 0xD800
    assert surrogate_class(r'root ::= (("a" [\ud800-\ue000]))') is None  # a range past the surrogates
    assert surrogate_class(r'root ::= (("a" [^\ud800-\udfff]))') is None  # negated
    assert surrogate_class(r'root ::= (("[\ud800]"))') is None  # a literal's brackets
    assert surrogate_class(r'root ::= Regex("^a[\\uDC01]$")') == 0xDC01
    assert surrogate_class(r'root ::= Regex("^[\\]\\uD800]$")') is None  # the class holds "]"


@pytest.mark.parametrize("so, starts", [
    (StructuredOutputs(grammar=r'root ::= [\uD800-\uDFFF]+ "a"'), False),
    (StructuredOutputs(regex=r"[\uDC00-\uDFFF]b"), False),
    (StructuredOutputs(grammar=r'root ::= "a" [\uD800-\uDBFF]'), True),  # past the start: the class scan's
    (StructuredOutputs(grammar=r'root ::= [\uD000-\uE000]'), True),
])
def test_the_vocabulary_search_finds_whether_valid_utf8_can_start(backend, so, starts):
    """The backstop behind the printed-grammar scans, on the real vocabulary: the raw compile, so the scans
    do not answer first."""
    matcher = backend.matcher(backend._compile(so))
    assert starts_validly(matcher, backend.utf8, backend._allowed, backend.info.stop_token_ids) is starts
