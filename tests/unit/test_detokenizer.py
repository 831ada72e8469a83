"""Incremental detokenization on real (locally trained) tokenizers, stop strings, and OutputText."""

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvrelay.shared.text.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, OutputText, StopStringMatcher
from kvrelay.shared.wire.sampling_params import SamplingParams

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "Grüße aus München, naïve café déjà vu.",
    "stop here STOP there, end of story. The end.",
] * 20

TEXTS = [
    "Hello world, the quick brown fox 😀 jumps over the lazy dog.",
    "café 🎉🎉 日本語 naïve — Grüße 👩‍👩‍👧!",
    "😀",
    "  leading spaces and trailing  ",
]


@pytest.fixture(scope="module")
def byte_bpe() -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE; the corpus has no emoji, so emoji become several byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def sentencepiece_like() -> PreTrainedTokenizerFast:
    """Llama style: "▁" word marks, byte fallback (<0xF0> ...), decoder strips the first space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"]))
    # The trainer has no byte-fallback option: append the 256 byte pieces as ordinary vocabulary.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(params=["byte_bpe", "sentencepiece_like"])
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return request.getfixturevalue(request.param)


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def emoji_byte_tokens(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """The tokens of "😀" that carry its bytes (SentencePiece adds a bare "▁" in front)."""
    return [i for i in encode(tokenizer, "😀") if REPLACEMENT_CHAR in tokenizer.decode([i])]


def test_emoji_really_spans_several_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    assert len(emoji_byte_tokens(tokenizer)) >= 2


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_incremental_text_equals_full_decode(tokenizer: PreTrainedTokenizerFast, text: str, chunk: int) -> None:
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[])
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids)
    assert detok.token_ids == ids


@pytest.mark.parametrize("text", TEXTS)
def test_prompt_context_keeps_the_first_space(tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    prompt = encode(tokenizer, "The end of story.")
    output = encode(tokenizer, " " + text)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    joined = "".join(detok.add([t]) for t in output) + detok.flush()
    full, prefix = tokenizer.decode(prompt + output), tokenizer.decode(prompt)
    assert full.startswith(prefix)
    assert joined == full[len(prefix) :]
    assert joined.startswith(" ")  # SentencePiece would strip it when decoding the output alone


def test_special_tokens_skipped_or_kept(byte_bpe: PreTrainedTokenizerFast) -> None:
    eos = byte_bpe.eos_token_id
    ids = encode(byte_bpe, "Hello") + [eos] + encode(byte_bpe, " world")
    for skip in (True, False):
        detok = IncrementalDetokenizer(byte_bpe, [], skip_special_tokens=skip)
        text = "".join(detok.add([t]) for t in ids)
        assert text == byte_bpe.decode(ids, skip_special_tokens=skip)
    assert "<|endoftext|>" not in byte_bpe.decode(ids, skip_special_tokens=True)


def test_incomplete_utf8_is_held_then_flushed(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = encode(tokenizer, "Hi") + emoji_byte_tokens(tokenizer)[:-1]  # generation stopped mid-emoji
    detok = IncrementalDetokenizer(tokenizer, [])
    streamed = [detok.add([t]) for t in ids]
    assert all(REPLACEMENT_CHAR not in d for d in streamed)
    assert "".join(streamed) == "Hi"
    tail = detok.flush()
    assert tail and set(tail) == {REPLACEMENT_CHAR}
    assert detok.text == tokenizer.decode(ids)
    assert detok.flush() == ""


# ---------------------------------------------------------------------------------------------------
# stop strings


def all_splits(text: str, rng: random.Random, count: int) -> list[list[str]]:
    """Char-by-char, whole, and random splits of text into deltas."""
    splits = [list(text), [text]]
    for _ in range(count):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(6, len(text) - 1))))
        bounds = [0, *cuts, len(text)]
        splits.append([text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])
    return splits


def run_matcher(deltas: list[str], stops: list[str], include: bool) -> tuple[list[str], str | None, str]:
    """Feed deltas; returns (emitted pieces, matched stop, flushed tail)."""
    matcher = StopStringMatcher(stops, include)
    emitted, matched = [], None
    for delta in deltas:
        piece, stop = matcher.feed(delta)
        emitted.append(piece)
        if stop is not None:
            matched = stop
            break
    return emitted, matched, matcher.flush() if matched is None else ""


CASES = [
    # (text, stops, matched stop, match start, match end)
    ("say hello world now", ["world"], "world", 10, 15),
    ("xxabcx", ["abc", "ab"], "ab", 2, 4),  # a stop that is a prefix of another completes first
    ("xxabcx", ["ab", "abc"], "ab", 2, 4),  # list order does not matter
    ("hello world", ["world", "lo"], "lo", 3, 5),  # earliest match wins
    ("a abab abc", ["abc", "aba"], "aba", 2, 5),
    ("xabcdx", ["abcd", "bc"], "bc", 2, 4),  # "bc" completes before "abcd" does
    ("xabcx", ["abc", "bc"], "abc", 1, 4),  # same end: the longer (earlier) match
    ("emoji 😀 stop", ["😀 s"], "😀 s", 6, 9),
]


@pytest.mark.parametrize(("text", "stops", "stop", "start", "end"), CASES)
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_any_split(text: str, stops: list[str], stop: str, start: int, end: int, include: bool) -> None:
    assert text[start:end] == stop
    cut = end if include else start
    for deltas in all_splits(text, random.Random(0), 40):
        emitted, matched, _ = run_matcher(deltas, stops, include)
        assert matched == stop, deltas
        assert "".join(emitted) == text[:cut], deltas
        # Until the matching call, nothing at or past the stop string's start has been emitted.
        assert len("".join(emitted[:-1])) <= start, deltas


@pytest.mark.parametrize("include", [False, True])
def test_partial_stop_held_back_then_flushed(include: bool) -> None:
    text = "we say STO and St and ST"
    for deltas in all_splits(text, random.Random(1), 40):
        matcher = StopStringMatcher(["STOP", "xyz"], include)
        emitted = []
        for delta in deltas:
            piece, stop = matcher.feed(delta)
            assert stop is None
            emitted.append(piece)
            so_far = "".join(emitted)
            # Any emitted text ending in a stop prefix would be a partial stop string reaching a client.
            assert not any(so_far.endswith("STOP"[:n]) for n in range(1, 4)), deltas
        assert "".join(emitted) + matcher.flush() == text
        assert matcher.flush() == ""


def test_matcher_without_stops_passes_through_and_ignores_input_after_match() -> None:
    assert StopStringMatcher([], False).feed("anything ST") == ("anything ST", None)
    matcher = StopStringMatcher(["END"], False)
    assert matcher.feed("a END b") == ("a ", "END")
    assert matcher.feed("more") == ("", None)
    with pytest.raises(ValueError):
        StopStringMatcher([""], False)


# ---------------------------------------------------------------------------------------------------
# OutputText: detokenizer + stop strings over real token ids


@pytest.mark.parametrize("include", [False, True])
def test_output_text_stop_across_token_boundaries(tokenizer: PreTrainedTokenizerFast, include: bool) -> None:
    text = "Hello world, the quick brown fox 😀 jumps over the lazy dog."
    ids = encode(tokenizer, text)
    for stop in ("k bro", "😀 j", "lazy dog."):
        out = OutputText(tokenizer, [], stop=[stop, "never there"], include_stop_str_in_output=include)
        deltas, result = [], None
        for t in ids:
            delta, stopped, stop_str = out.append([t])
            deltas.append(delta)
            assert REPLACEMENT_CHAR not in delta
            if stopped:
                result = stop_str
                break
        assert result == stop
        start = text.index(stop)
        want = text[: start + len(stop)] if include else text[:start]
        assert "".join(deltas) == out.text == want
        assert len("".join(deltas[:-1])) <= start
        assert out.append([ids[-1]]) == ("", True, stop)
        assert out.finish() == ""


def test_output_text_flushes_held_text_when_generation_ends(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "the end of story. The en"
    ids = encode(tokenizer, text)
    params = SamplingParams(stop=["The end."], include_stop_str_in_output=False)
    out = OutputText.from_params(tokenizer, [], params)
    streamed = "".join(out.append([t])[0] for t in ids)
    assert not streamed.endswith("The en")  # held back: it could still become "The end."
    tail = out.finish()
    assert streamed + tail == out.text == text
    assert not out.stopped


def test_output_text_finish_can_complete_a_stop_from_held_bytes(byte_bpe: PreTrainedTokenizerFast) -> None:
    # The last token is the first byte of an emoji: the detokenizer holds it until finish() decodes it
    # as U+FFFD, which must still go through the stop matcher.
    ids = encode(byte_bpe, "ok 😀")[:-1]
    out = OutputText(byte_bpe, [], stop=[REPLACEMENT_CHAR])
    streamed = "".join(out.append([t])[0] for t in ids)
    assert not out.stopped
    assert streamed + out.finish() == out.text == "ok "
    assert out.stopped and out.matcher.matched == REPLACEMENT_CHAR
