"""shared.loader: sharded checkpoints, dtypes, clear errors for broken checkpoints, dummy weights
of preset shapes, and the eos-id collection in shared.tokenizer."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from kvrelay.shared.config.engine import ModelConfig
from kvrelay.shared.config.presets import PRESETS, get_preset
from kvrelay.shared.engine.loader import load_model
from kvrelay.shared.engine.models import build_model
from kvrelay.shared.repo.model_shape import max_model_len
from kvrelay.shared.text.tokenizer import eos_token_ids
from tests.unit.test_models import PagedBatch, hf_logits, make_hf_model, random_tokens

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model(LlamaConfig(**TINY), seed=3)


@pytest.fixture(scope="module")
def checkpoint(hf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf_model.save_pretrained(path)
    return path


def broken_copy(checkpoint, tmp_path):
    """A private copy of the checkpoint a test can damage."""
    out = tmp_path / "model"
    shutil.copytree(checkpoint, out)
    return out


def prompt_logits(model, tokens):
    (logits,) = PagedBatch(model).step([(0, tokens)])
    return logits


def test_sharded_checkpoint_loads(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / "model.safetensors").exists()
    model, hf_config = load_model(ModelConfig(model=str(tmp_path)), "cpu", progress=False)
    assert hf_config["architectures"] == ["LlamaForCausalLM"]
    tokens = random_tokens(9, 256, seed=0)
    torch.testing.assert_close(prompt_logits(model, tokens), hf_logits(hf_model, tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_loading(checkpoint, hf_model, dtype):
    model, _ = load_model(ModelConfig(model=str(checkpoint), dtype=dtype), "cpu", progress=False)
    assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    tokens = random_tokens(9, 256, seed=1)
    ours, ref = prompt_logits(model, tokens), hf_logits(hf_model, tokens)
    assert ours.dtype == torch.float32
    # half precision drifts, but only by rounding: well under the spread of the logits
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_progress_bar_is_shown(checkpoint, capsys):
    load_model(ModelConfig(model=str(checkpoint)), "cpu")
    assert "Loading weights" in capsys.readouterr().err


def test_truncated_file_raises_clearly(checkpoint, tmp_path):
    model_dir = broken_copy(checkpoint, tmp_path)
    file = model_dir / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match=r"model\.safetensors is truncated"):
        load_model(ModelConfig(model=str(model_dir)), "cpu", progress=False)


def test_corrupt_header_raises_clearly(checkpoint, tmp_path):
    model_dir = broken_copy(checkpoint, tmp_path)
    file = model_dir / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:40] = b"\xff" * 32  # the JSON header
    file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupt safetensors header"):
        load_model(ModelConfig(model=str(model_dir)), "cpu", progress=False)


@pytest.mark.parametrize("edit,message", [
    ("drop", r"missing tensor\(s\).*model\.layers\.1\.mlp\.up_proj\.weight"),
    ("extra", r"unexpected tensor 'model\.layers\.7\.mlp\.up_proj\.weight'"),
    ("reshape", r"shape mismatch for tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"),
])
def test_checkpoint_contents_are_validated(checkpoint, tmp_path, edit, message):
    model_dir = broken_copy(checkpoint, tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    if edit == "drop":
        del tensors[name]
    elif edit == "extra":
        tensors["model.layers.7.mlp.up_proj.weight"] = tensors[name].clone()
    else:
        tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        load_model(ModelConfig(model=str(model_dir)), "cpu", progress=False)


def test_missing_shard_is_named(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(ModelConfig(model=str(tmp_path)), "cpu", progress=False)


def test_directory_without_weights_or_config(checkpoint, tmp_path):
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_model(ModelConfig(model=str(tmp_path)), "cpu", progress=False)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(ModelConfig(model=str(tmp_path / "nowhere")), "cpu", progress=False)


def test_max_model_len_beyond_positions_is_refused(checkpoint):
    with pytest.raises(ValueError, match="max_model_len 4096"):
        load_model(ModelConfig(model=str(checkpoint), max_model_len=4096), "cpu", progress=False)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2", "tiny-bloom"])
def test_dummy_preset_builds_and_runs(preset):
    config = ModelConfig(model=f"dummy:{preset}", load_format="dummy", seed=7)
    model, hf_config = load_model(config, "cpu")
    assert hf_config == get_preset(preset)
    tokens = random_tokens(12, model.vocab_size, seed=2)
    logits = prompt_logits(model, tokens)
    assert logits.shape == (12, model.vocab_size) and torch.isfinite(logits).all()
    assert logits.std() > 0  # random weights, not zeros
    again, _ = load_model(config, "cpu")
    torch.testing.assert_close(prompt_logits(again, tokens), logits, atol=0, rtol=0)  # seeded
    other, _ = load_model(ModelConfig(model=f"dummy:{preset}", load_format="dummy", seed=8), "cpu")
    assert not torch.equal(prompt_logits(other, tokens), logits)


def test_dummy_bf16_is_allocated_in_bf16():
    model, _ = load_model(ModelConfig(model="dummy:tiny-llama", load_format="dummy", dtype="bfloat16"), "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.isfinite(prompt_logits(model, [1, 5, 9, 3])).all()


def test_unknown_preset_and_load_format():
    with pytest.raises(ValueError, match="unknown model preset 'llama-9000'"):
        load_model(ModelConfig(model="dummy:llama-9000", load_format="dummy"), "cpu")
    with pytest.raises(ValueError, match="load_format"):
        load_model(ModelConfig(model="dummy:tiny-llama", load_format="pt"), "cpu")


@pytest.mark.parametrize("preset,params", [
    ("llama-3-8b", 8.030e9), ("llama-2-7b", 6.738e9), ("qwen2-0.5b", 0.494e9),
    ("smollm2-135m", 0.1345e9), ("gpt2", 0.1244e9), ("bloom-560m", 0.5592e9),
])
def test_preset_parameter_counts(preset, params):
    model = build_model(get_preset(preset), torch.bfloat16, device="meta")  # sized, never allocated
    assert all(p.is_meta for p in model.parameters())
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - params) / params < 1e-3, count


def test_llama_3_8b_shape():
    model = build_model(get_preset("llama-3-8b"), torch.bfloat16, device="meta")
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.vocab_size) == (32, 8, 128, 128256)
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == (4096 + 2 * 1024, 4096)
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 14336, 4096)
    assert max_model_len(get_preset("llama-3-8b")) == 8192
    assert set(PRESETS) >= {"llama-3-8b", "llama-2-7b", "qwen2-0.5b", "smollm2-135m", "gpt2", "bloom-560m",
                            "tiny-llama", "tiny-gpt2", "tiny-bloom"}


def test_sliding_window_caps_max_model_len():
    assert max_model_len({"max_position_embeddings": 32768, "sliding_window": 4096}) == 4096
    assert max_model_len(get_preset("qwen2-0.5b")) == 131072  # names a window but does not use it


def test_eos_token_ids_collects_every_source(tmp_path):
    class Tok:
        eos_token_id = 7

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    assert eos_token_ids(Tok(), {"eos_token_id": 128001}, tmp_path) == [128001, 128009, 7]
    assert eos_token_ids(None, {"eos_token_id": 2}, None) == [2]
    assert eos_token_ids(Tok(), {}, tmp_path / "missing") == [7]


def test_tied_checkpoint_may_carry_a_stray_lm_head(tmp_path):
    hf = make_hf_model(LlamaConfig(**TINY, tie_word_embeddings=True), seed=5)
    hf.save_pretrained(tmp_path)
    tokens = random_tokens(7, 256, seed=6)
    clean, _ = load_model(ModelConfig(model=str(tmp_path)), "cpu", progress=False)
    tensors = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])  # differs on purpose
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    stray, _ = load_model(ModelConfig(model=str(tmp_path)), "cpu", progress=False)
    # the embedding stays the output matrix, as HF ties it
    torch.testing.assert_close(prompt_logits(stray, tokens), prompt_logits(clean, tokens), atol=0, rtol=0)
    torch.testing.assert_close(prompt_logits(stray, tokens), hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)
