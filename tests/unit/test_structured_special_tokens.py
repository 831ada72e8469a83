"""Special (control) tokens are never text under a grammar: on the real SmolLM2 tokenizer and on the other
tokenizer shapes tests build (a byte-level BPE as GPT-2's, a byte-fallback one as Llama's), no mask row
allows a special id, whatever the grammar kind and however far the walk, except a stop token where the
grammar may end."""

import json
from pathlib import Path

import pytest

from kvrelay.shared.engine.structured.backend import GrammarBackend
from kvrelay.shared.engine.structured.bitmask import allowed_ids, new_bitmask
from kvrelay.shared.engine.structured.tokenizer_info import special_token_ids
from kvrelay.shared.engine.structured.utf8 import COMPLETE, REJECT
from kvrelay.shared.text.tokenizer import load_tokenizer
from kvrelay.shared.wire.structured_outputs import StructuredOutputs
from tests.integration.gateway_harness import build_tokenizer

STRING_SCHEMA = json.dumps({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"],
                            "additionalProperties": False})
# each constraint, and text it accepts: its walk passes through states where any text may come next
CONSTRAINTS = {
    "json": (StructuredOutputs(json=STRING_SCHEMA), '{"s": "say <|im_start|> hi"}'),
    "regex": (StructuredOutputs(regex=r"[^\n]{0,40}"), "free <|endoftext|> text"),
    "choice": (StructuredOutputs(choice=["<|im_start|>", "<|endoftext|>x", "<s>", "</s>"]), "<|endoftext|>x"),
    "grammar": (StructuredOutputs(grammar='root ::= "<" [^\\n]* ">"'), "<|im_end|> and <s>"),
}


def _byte_fallback_tokenizer(out: Path) -> Path:
    """A Llama-style tokenizer: <unk>, <s>, </s>, the 256 byte tokens and a few pieces, no merges."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", *"abcdefghijklmnopqrstuvwxyz<>|/_"]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=["smollm2", "byte-level-bpe", "byte-fallback"])
def tokenizer_dir(request, smollm2_dir, tmp_path_factory) -> Path:
    if request.param == "smollm2":
        return smollm2_dir
    out = tmp_path_factory.mktemp(request.param)
    return build_tokenizer(out) if request.param == "byte-level-bpe" else _byte_fallback_tokenizer(out)


@pytest.fixture(scope="module")
def setup(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    backend = GrammarBackend(str(tokenizer_dir), [])  # as the engine makes it: the tokenizer's EOS stops
    return tok, backend, set(special_token_ids(tok))


def _allowed(backend, matcher) -> set[int]:
    mask = new_bitmask(1, backend.mask_words)
    matcher.fill_next_token_bitmask(mask, 0)
    return set(allowed_ids(mask[0], backend.vocab_size))


def test_the_tokenizers_mark_their_control_tokens_special(setup):
    tok, _, special = setup
    assert special >= {tok.eos_token_id} and len(special) >= 3
    assert tok.convert_tokens_to_ids("<|im_start|>" if "<|im_start|>" in tok.get_vocab() else "<s>") in special


@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_no_special_token_is_ever_allowed_but_a_stop_where_the_grammar_ends(setup, kind):
    tok, backend, special = setup
    so, walk = CONSTRAINTS[kind]
    stops = [tok.eos_token_id]
    matcher = backend.matcher(backend.compile(so), stops)
    spelling, rest = backend.info.decoded_vocab, walk.encode()
    while True:  # the walk's text spelled greedily by the longest allowed token, whatever the tokenizer
        allowed = _allowed(backend, matcher)
        assert not (allowed & special) - set(stops), f"{kind} before {rest!r}"
        assert (tok.eos_token_id in allowed) == matcher.is_completed(), f"{kind} before {rest!r}"
        if not rest:
            break
        token = max((t for t in allowed if spelling[t] and rest.startswith(spelling[t])), key=lambda t: len(spelling[t]))
        assert matcher.accept_token(token)
        rest = rest[len(spelling[token]):]
    assert tok.eos_token_id in allowed and matcher.accept_token(tok.eos_token_id) and matcher.is_terminated()


def test_a_requests_own_stop_id_ends_the_output_though_it_is_special(setup):
    tok, backend, special = setup
    other = next(t for t in sorted(special) if t != tok.eos_token_id)
    matcher = backend.matcher(backend.compile(StructuredOutputs(regex="ab")), [other])
    assert matcher.accept_string("ab") and _allowed(backend, matcher) == {other}
    assert matcher.accept_token(other) and matcher.is_terminated()


def test_special_tokens_are_textless_for_the_utf8_mask(setup):
    _, backend, special = setup
    for t in special:
        assert backend.info.decoded_vocab[t] == b""
        assert backend.utf8.advance(COMPLETE, t) == COMPLETE and backend.utf8.advance(1, t) == REJECT  # never mid-character


def test_generation_pushed_towards_control_tokens_still_spells_text_and_ends(smollm2_dir):
    """SmolLM2 greedy, every special token's logit raised by 100: inside the JSON string none is sampled,
    and the output ends with its EOS as soon as the document is complete (EOS is pushed too)."""
    from kvrelay import LLM, SamplingParams

    tok = load_tokenizer(smollm2_dir)
    special = special_token_ids(tok)
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 24}}, "required": ["s"],
              "additionalProperties": False}
    llm = LLM(model=str(smollm2_dir), max_model_len=256, device="cpu", seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputs(json=json.dumps(schema)),
                            logit_bias={t: 100.0 for t in special})
    (out,) = llm.generate([{"prompt_token_ids": tok.encode("<|im_start|>user\nSay hi<|im_end|>\n")}], [params])
    c = out.outputs[0]
    assert c.finish_reason == "stop", c
    assert not set(c.token_ids) & set(special) - {tok.eos_token_id}, c.token_ids
    assert isinstance(json.loads(c.text)["s"], str), c.text
