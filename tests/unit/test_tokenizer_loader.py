"""``load_tokenizer`` (no torch, unlike transformers' AutoTokenizer) tokenizes, decodes and renders chat
templates exactly as AutoTokenizer's choice does: on the gateway tests' trained BPE, the real SmolLM2
tokenizer (also under the model-specific class names older checkpoints give), the benchmarks'
word-level tokenizer and a directory naming no class."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvrelay.shared.repo.model_source import dummy_tokenizer_dir
from kvrelay.shared.text.tokenizer import TOKENIZER_FILES, load_tokenizer
from tests.integration.gateway_harness import build_tokenizer

TEXTS = ["Hello world! The quick brown fox jumps over the lazy dog.", "  leading spaces, trailing  ",
         "über naïve café 日本語 🦊", "<|im_start|>user\nspecial tokens inline<|im_end|>", "<t3> <t17> <t9>", ""]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Tell me a story about a fox"}],
    [{"role": "user", "content": "ünïcödé and <b>markup</b>, {{ braces }}"}],
]


def _retyped(src: Path, out: Path, tokenizer_class: str | None) -> Path:
    shutil.copytree(src, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("tokenizer_class", None)
    if tokenizer_class is not None:
        config["tokenizer_class"] = tokenizer_class
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module", params=["trained-bpe", "smollm2", "smollm2-gpt2", "smollm2-llama", "word-level",
                                        "no-class"])
def tokenizer_dir(request, tmp_path_factory, smollm2_dir) -> Path:
    tmp = tmp_path_factory.mktemp(request.param)
    return {
        "trained-bpe": lambda: build_tokenizer(tmp / "tok"),
        "smollm2": lambda: smollm2_dir,
        "smollm2-gpt2": lambda: _retyped(smollm2_dir, tmp / "tok", "GPT2TokenizerFast"),
        "smollm2-llama": lambda: _retyped(smollm2_dir, tmp / "tok", "LlamaTokenizerFast"),
        "word-level": lambda: dummy_tokenizer_dir("tiny-llama"),
        "no-class": lambda: _retyped(smollm2_dir, tmp / "tok", None),
    }[request.param]()


def test_same_special_tokens_as_auto_tokenizer(tokenizer_dir):
    ours, ref = load_tokenizer(tokenizer_dir), AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    assert (len(ours), ours.eos_token_id, ours.bos_token_id, ours.pad_token_id, ours.all_special_ids) == (
        len(ref), ref.eos_token_id, ref.bos_token_id, ref.pad_token_id, ref.all_special_ids)


def test_encode_decode_as_auto_tokenizer(tokenizer_dir):
    ours, ref = load_tokenizer(tokenizer_dir), AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    for text in TEXTS:
        for special in (True, False):
            ids = ref.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_chat_template_as_auto_tokenizer(tokenizer_dir):
    ours, ref = load_tokenizer(tokenizer_dir), AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    assert ours.chat_template == ref.chat_template
    if ref.chat_template is None:
        return
    rendered = set()
    for chat in CHATS:
        for add_generation_prompt in (True, False):
            text = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt) == text
            rendered.add(text)
    assert len(rendered) == 2 * len(CHATS)  # the template really rendered each conversation


def test_a_checkpoint_without_tokenizer_files_is_refused_before_transformers_looks(tmp_path):
    # a model saved without its tokenizer (weights + config.json): the gateway tries it at /ready
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    code = ("import sys\nfrom kvrelay.shared.text.tokenizer import TOKENIZER_FILES, load_tokenizer\n"
            f"try:\n    load_tokenizer({str(tmp_path)!r})\nexcept FileNotFoundError as exc:\n    print(exc)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == f"no tokenizer in {tmp_path} (none of {', '.join(TOKENIZER_FILES)})\nFalse\n"
