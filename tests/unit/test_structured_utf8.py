"""Structured outputs never produce invalid UTF-8 (RFC 3629), on the real SmolLM2 tokenizer, whose byte-level
vocabulary holds a token for nearly every single byte: xgrammar alone lets surrogates (and, in a schema's pattern
strings, overlong forms) through; the engine's mask refuses every token that would make the bytes invalid,
given a character left incomplete by the tokens before, and still allows every valid character."""

import json

import pytest
import torch

from kvrelay import LLM, SamplingParams
from kvrelay.shared.engine.request import Request
from kvrelay.shared.engine.structured.bitmask import allowed_ids, new_bitmask
from kvrelay.shared.engine.structured.manager import StructuredOutputManager
from kvrelay.shared.engine.structured.utf8 import COMPLETE, REJECT, Utf8Table
from kvrelay.shared.wire.structured_outputs import StructuredOutputs

EOS = 2
PLAIN = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"], "additionalProperties": False}
BOUNDED = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}, "required": ["s"],
           "additionalProperties": False}  # written as a pattern (json_strings.py): xgrammar's other string path
SCHEMAS = {"string": PLAIN, "maxLength": BOUNDED}
OPEN = b'{"s": "'
# the incomplete characters after which xgrammar 0.2.9 alone allows a byte that makes them invalid:
# the surrogates' ED A0..BF everywhere, the overlong E0 80..9F and F0 80..8F in pattern strings
LOOSE = {"string": [b"\xed"], "maxLength": [b"\xe0", b"\xed", b"\xf0"]}
# incomplete characters to continue from: each pending state (utf8.py), after one token and after several
PENDING = [b"\xc3", b"\xe0", b"\xe4", b"\xed", b"\xef", b"\xf0", b"\xf3", b"\xf4", b"\xe4\xb8", b"\xed\x9f",
           b"\xf0\x9f", b"\xf4\x8f", b"\xf0\x9f\x98", b"\xf4\x8f\xbf"]


@pytest.fixture(scope="module")
def manager(smollm2_dir):
    manager = StructuredOutputManager(str(smollm2_dir))
    yield manager
    manager.close()


@pytest.fixture(scope="module")
def vocab(manager) -> list[bytes]:
    """Each token's bytes, as the grammar matches them (the backend is built by the first compile)."""
    manager.cache.submit(StructuredOutputs(json=json.dumps(PLAIN))).result()
    return [bytes(b) for b in manager.cache.backend().info.decoded_vocab]


def _byte_ids(vocab: list[bytes]) -> dict[int, int]:
    """byte -> its single-byte token (SmolLM2 has one for each byte but a few control and never-valid ones)."""
    return {b[0]: t for t, b in enumerate(vocab) if len(b) == 1}


def _byte_tokens(vocab: list[bytes], data: bytes) -> list[int]:
    ids = _byte_ids(vocab)
    return [ids[b] for b in data]


def _allowed(manager, schema: dict | StructuredOutputs, output: list[int]) -> set[int]:
    """The token ids the engine's mask allows after ``output``."""
    so = schema if isinstance(schema, StructuredOutputs) else StructuredOutputs(json=json.dumps(schema))
    req = Request("r", [1], SamplingParams(max_tokens=64, structured_outputs=so), eos_token_id=EOS)
    manager.attach(req)
    req.output_token_ids = list(output)
    rows, mask = manager.bitmask([req])
    assert rows.tolist() == [0]
    return set(allowed_ids(mask[0], manager.cache.backend().vocab_size))


def _utf8(data: bytes) -> str:
    """"complete", "pending" (valid so far, its last character unfinished) or "invalid", by Python's strict
    decoder (RFC 3629's: no surrogates, no overlong forms, nothing past U+10FFFF)."""
    try:
        data.decode("utf-8")
        return "complete"
    except UnicodeDecodeError as exc:
        return "pending" if exc.reason == "unexpected end of data" else "invalid"


@pytest.mark.parametrize("schema, data", [
    ("string", b"\xed\xa0\x80"), ("maxLength", b"\xed\xa0\x80"), ("maxLength", b"\xe0\x80\x80"),
    ("maxLength", b"\xf0\x80\x80\x80"), ("maxLength", b"\xf0\x8f\xbf\xbf"),
], ids=["surrogate", "surrogate-maxLength", "overlong-3", "overlong-4", "overlong-4-max"])
def test_xgrammar_alone_accepts_these_invalid_sequences(manager, vocab, schema, data):
    """What the engine's UTF-8 mask is for: if this fails, xgrammar refuses them itself now."""
    backend = manager.cache.backend()
    matcher = backend.matcher(backend.compile(StructuredOutputs(json=json.dumps(SCHEMAS[schema]))), [EOS])
    tokens = _byte_tokens(vocab, OPEN + data + b'"}')
    assert all(matcher.accept_token(t) for t in tokens) and matcher.accept_token(EOS)


@pytest.mark.parametrize("schema", ["string", "maxLength"])
def test_each_pending_character_allows_exactly_its_valid_continuations(manager, vocab, schema):
    """Over the whole vocabulary: after a complete character and after each incomplete one (spanning tokens),
    the mask allows exactly what xgrammar allows and keeps the bytes valid UTF-8; never EOS mid-character."""
    backend = manager.cache.backend()
    compiled = backend.compile(StructuredOutputs(json=json.dumps(SCHEMAS[schema])))
    loose = []  # where xgrammar alone allows a token that makes the bytes invalid
    for pending in [b"", *PENDING]:
        output = _byte_tokens(vocab, OPEN + pending)
        matcher = backend.matcher(compiled, [EOS])
        assert all(matcher.accept_token(t) for t in output)
        mask = new_bitmask(1, backend.mask_words)
        matcher.fill_next_token_bitmask(mask, 0)
        grammatical = set(allowed_ids(mask[0], len(vocab)))
        expected = {t for t in grammatical if t != EOS and _utf8(pending + vocab[t]) != "invalid"}
        assert _allowed(manager, SCHEMAS[schema], output) == expected, f"after {pending!r}"
        if grammatical - expected - {EOS}:
            loose.append(pending)
    assert loose == LOOSE[schema]


def test_a_character_split_over_tokens_continues_only_validly(manager, vocab):
    """The UTF-8 state carries across tokens: after ED (a lead that allows only 80..9F next) the mask refuses
    A0 (a surrogate) and a new lead or an ASCII quote; after ED 9F it wants one more continuation byte."""
    byte = _byte_ids(vocab)
    after_ed = _allowed(manager, PLAIN, _byte_tokens(vocab, OPEN + b"\xed"))
    assert {byte[b] for b in range(0x80, 0xA0)} <= after_ed
    assert not after_ed & {byte[b] for b in [0xA0, 0xBF, ord('"'), ord("a"), 0xC3, 0xED]} and EOS not in after_ed
    after_ed_9f = _allowed(manager, PLAIN, _byte_tokens(vocab, OPEN + b"\xed\x9f"))
    assert {byte[b] for b in range(0x80, 0xC0)} <= after_ed_9f
    assert not after_ed_9f & {byte[b] for b in [ord('"'), 0x7F, 0xC2, 0xC3]}


def test_a_sequence_whose_bytes_went_invalid_ends_instead_of_breaking_the_step(manager, vocab):
    """A token from outside the mask (e.g. forced) that makes the bytes invalid ends that sequence alone."""
    allowed = _allowed(manager, PLAIN, _byte_tokens(vocab, OPEN + b"\xed\xa0"))
    assert allowed == {EOS}


def test_a_grammar_that_demands_a_surrogate_ends_where_nothing_valid_continues(manager, vocab):
    """An EBNF class of surrogates and U+0800 past the start (not surrogates only, so the compile's checks let
    it through, utf8_grammar.py) takes bytes ED A0..BF xx: after ED nothing is both grammatical and valid (U+0800
    starts with E0), so the row allows only the stop token instead of nothing (an all -inf row to sample from)."""
    so = StructuredOutputs(grammar='root ::= "a" [\\uD800-\\uDFFF\\u0800]')
    assert _allowed(manager, so, _byte_tokens(vocab, b"a\xed")) == {EOS}


def test_valid_characters_of_every_width_pass_token_by_token(manager, vocab, smollm2_dir):
    from kvrelay.shared.text.tokenizer import load_tokenizer

    text = '{"s": "é中😀"}'
    for output in (load_tokenizer(smollm2_dir).encode(text, add_special_tokens=False),
                   _byte_tokens(vocab, text.encode())):
        for i, token in enumerate(output):
            assert token in _allowed(manager, BOUNDED, output[:i]), (output, i)
        assert EOS in _allowed(manager, BOUNDED, output)


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(model=str(smollm2_dir), max_model_len=256, device="cpu", seed=0)


def test_sampled_strings_stay_valid_utf8_within_max_length(llm, vocab):
    """The model pushed hard towards byte tokens (greedy, logit bias): towards ED and A0, which xgrammar lets
    spell a surrogate; towards F0 9F 98 80, which in a pattern string it lets spell an overlong F0 80 80 80;
    towards C3 A9 (é). Each output is valid UTF-8, parses, and its string holds at most maxLength characters."""
    byte = _byte_ids(vocab)
    so = StructuredOutputs(json=json.dumps(BOUNDED))

    def pushed(data: bytes) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so,
                              logit_bias={byte[b]: 100.0 for b in data})

    outs = llm.generate([{"prompt_token_ids": [1, 504, 3456]}] * 3,
                        [pushed(b"\xed\xa0"), pushed(b"\xf0\x9f\x98\x80"), pushed(b"\xc3\xa9")])
    strings = []
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c
        data = b"".join(vocab[t] for t in c.token_ids if t != EOS)
        text = data.decode("utf-8")  # strict: no surrogate, no overlong
        assert text == c.text
        strings.append(json.loads(text)["s"])
    hangul, astral, accented = strings
    assert len(hangul) == 3 and all("\ud000" <= ch <= "\ud7ff" for ch in hangul), hangul
    assert len(astral) == 3 and all(ord(ch) >= 0x10000 for ch in astral), astral
    assert accented == "ééé"


def test_the_table_walks_tokens_like_pythons_decoder(manager, vocab):
    """Every token from every state: the table's verdict is the strict decoder's, the state after it too;
    a stop or special token (no text) ends nothing but a complete character."""
    table = manager.cache.backend().utf8
    textless = {EOS, *manager.cache.backend().info.special_token_ids}
    for pending in [b"", *PENDING]:
        state = COMPLETE
        for t in _byte_tokens(vocab, pending):
            state = table.advance(state, t)
        for t, data in enumerate(vocab):
            after = table.advance(state, t)
            if t in textless:
                assert (after == REJECT) == bool(pending)
                continue
            verdict = "invalid" if after == REJECT else "complete" if after == COMPLETE else "pending"
            assert verdict == _utf8(pending + data), (pending, data, after)



def test_a_token_hiding_an_invalid_sequence_is_taken_out_after_a_complete_character():
    """A vocabulary unlike SmolLM2's, built here: a token that starts like a character but holds a surrogate
    further on is taken out of a row after a complete character, and that row is reported narrowed."""
    vocab = [bytes([b]) for b in range(128)] + [b"a\xed\xa0\x80", "é".encode(), b"\xed\x9f\xbf"]
    table = Utf8Table(vocab, [], words=5)
    hidden, accented, last = 128, 129, 130
    mask = torch.zeros((2, 5), dtype=torch.int32)
    for t in (ord("a"), hidden, accented, last):
        mask[:, t // 32] |= 1 << (t % 32)
    assert table.restrict(mask, [0, 1], [COMPLETE, COMPLETE]) == [0, 1]
    assert set(allowed_ids(mask[0], len(vocab))) == {ord("a"), accented, last}
    assert table.restrict(mask, [0, 1], [COMPLETE, COMPLETE]) == []  # nothing left to take
