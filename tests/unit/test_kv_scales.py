"""An fp8 KV cache's per-layer scales from the checkpoint (shared/engine/kv_scales.py): every name vLLM
loads them under is read into the layers' scales; a checkpoint with scales for some layers only, or a
per-head scale, is one line naming the tensor, before anything serves; a cache of the model's dtype
ignores the scales and says so once; the digest a handoff ask carries tells two sets of scales apart.
That the engine divides by them (its logprobs meet an HF reference rounding through fp8 with the same
scales) is tests/unit/test_kv_fp8_models.py's ``test_fp8_kv_reads_the_checkpoints_kv_scales``."""

import json
import logging

import pytest

from kvrelay import LLM
from kvrelay.shared.engine.kv_scales import scales_digest
from tests.kv_scale_checkpoint import self_attn_scales, with_kv_scales

KV_SCHEME = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False, "symmetric": True}


def _runner(model_dir, kv_cache_dtype: str = "fp8"):
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=64, kv_cache_dtype=kv_cache_dtype)
    return llm.engine.core.runner


@pytest.mark.parametrize(("arch", "tensors", "want"), [
    # AutoFP8's one kv_scale for K and V; ModelOpt's k_proj.k_scale / v_proj.v_scale
    ("llama", {"model.layers.0.self_attn.kv_scale": 0.37, "model.layers.1.self_attn.k_proj.k_scale": 2.3,
               "model.layers.1.self_attn.v_proj.v_scale": 0.53}, [[0.37, 0.37], [2.3, 0.53]]),
    # older compressed-tensors: the projections' output_scale
    ("qwen2", {"model.layers.0.self_attn.k_proj.output_scale": [0.3], "model.layers.0.self_attn.v_proj.output_scale":
               [0.7], "model.layers.1.self_attn.k_proj.output_scale": [1.9], "model.layers.1.self_attn.v_proj.output_scale":
               [0.45]}, [[0.3, 0.7], [1.9, 0.45]]),
    # llm-compressor's k_scale / v_scale, under GPT-2's attention module
    ("gpt2", self_attn_scales({0: (0.6, 1.7), 1: (3.1, 0.29)}, "transformer.h", "attn"), [[0.6, 1.7], [3.1, 0.29]]),
])
def test_every_name_vllm_loads_sets_the_layers_scales(tiny_model_dirs, tmp_path, arch, tensors, want):
    runner = _runner(with_kv_scales(tiny_model_dirs[arch], tmp_path / arch, tensors))
    assert runner.kv_scales.flatten().tolist() == pytest.approx(sum(want, []))
    assert runner.kv_scales_digest == scales_digest(want, 2) != scales_digest([], 2)


def test_a_compressed_tensors_checkpoint_quantizing_only_the_kv_cache_loads(tiny_model_dirs, tmp_path):
    """llm-compressor's KV-only recipe: no weight groups, a ``kv_cache_scheme``, and the layers' k/v_scale."""
    ckpt = with_kv_scales(tiny_model_dirs["llama"], tmp_path / "ct", self_attn_scales({0: (0.4, 1.3), 1: (2.2, 0.8)}))
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {},
                                     "kv_cache_scheme": KV_SCHEME, "format": "dense"}
    (ckpt / "config.json").write_text(json.dumps(config))
    assert _runner(ckpt).kv_scales.flatten().tolist() == pytest.approx([0.4, 1.3, 2.2, 0.8])


@pytest.mark.parametrize("scheme", [{"type": "int", "num_bits": 8, "strategy": "tensor"},
                                    {"type": "float", "num_bits": 8, "strategy": "attn_head"}])
def test_a_kv_cache_scheme_for_another_cache_is_one_line(tiny_model_dirs, tmp_path, scheme):
    """int8 KV or per-head scales are not fp8 per-layer scales: read as such they would misread every block."""
    ckpt = with_kv_scales(tiny_model_dirs["llama"], tmp_path / "scheme", self_attn_scales({0: (0.4, 1.3),
                                                                                         1: (2.2, 0.8)}))
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {},
                                     "kv_cache_scheme": KV_SCHEME | scheme, "format": "dense"}
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"^quantization_config.kv_cache_scheme {{type '{scheme['type']}', num_bits 8, "
                                         rf"strategy '{scheme['strategy']}'}}: --kv-cache-dtype fp8 reads 8-bit float "
                                         r"scales per tensor \(one per layer\) only$"):
        _runner(ckpt)


@pytest.mark.parametrize(("tensors", "missing"), [
    (self_attn_scales({0: (0.5, 2.0)}), "model.layers.1.self_attn.k_scale"),
    ({"model.layers.0.self_attn.k_scale": 0.5, "model.layers.1.self_attn.k_scale": 0.5},
     "model.layers.0.self_attn.v_scale"),
    ({"model.layers.0.self_attn.k_proj.k_scale": 0.5, "model.layers.1.self_attn.k_proj.k_scale": 0.5,
      "model.layers.1.self_attn.v_proj.v_scale": 2.0}, "model.layers.0.self_attn.v_proj.v_scale"),
])
def test_scales_for_some_layers_only_are_one_line_naming_the_missing_tensor(tiny_model_dirs, tmp_path, tensors,
                                                                             missing):
    ckpt = with_kv_scales(tiny_model_dirs["llama"], tmp_path / "partial", tensors)
    layers = len({name.split(".")[2] for name in tensors})
    with pytest.raises(ValueError, match=rf"^KV scale '{missing}' is missing: the checkpoint has KV cache scales for "
                                         rf"{layers} of its 2 layers; every layer needs its K and V scale$"):
        _runner(ckpt)


def test_a_per_head_scale_is_one_line_naming_it(tiny_model_dirs, tmp_path):
    tensors = self_attn_scales({0: (0.5, 2.0), 1: (0.5, 2.0)}) | {"model.layers.1.self_attn.k_scale": [0.5, 0.7]}
    ckpt = with_kv_scales(tiny_model_dirs["llama"], tmp_path / "per-head", tensors)
    with pytest.raises(ValueError, match=r"^KV scale 'model.layers.1.self_attn.k_scale' has 2 values: one scale per "
                                         r"layer is supported \(not per head\)$"):
        _runner(ckpt)


def test_a_cache_of_the_models_dtype_ignores_the_scales_and_says_so_once(tiny_model_dirs, tmp_path, caplog):
    ckpt = with_kv_scales(tiny_model_dirs["llama"], tmp_path / "auto", self_attn_scales({0: (0.37, 0.61),
                                                                                        1: (2.3, 0.53)}))
    caplog.set_level(logging.INFO, logger="kvrelay.shared.engine.kv_scales")
    runner = _runner(ckpt, "auto")
    said = [r.getMessage() for r in caplog.records if "KV cache scales" in r.getMessage()]
    assert said == [f"{ckpt} carries fp8 KV cache scales; --kv-cache-dtype auto ignores them (they apply to "
                    "--kv-cache-dtype fp8 only)"]
    assert runner.kv_scales.tolist() == [[1.0, 1.0], [1.0, 1.0]] and runner.kv_scales_digest == ""


def test_the_digest_is_the_scales(tiny_model_dirs, tmp_path):
    """Two fp8 caches agree on the digest exactly when they read blocks with the same scales."""
    plain = _runner(tiny_model_dirs["llama"]).kv_scales_digest
    ones = with_kv_scales(tiny_model_dirs["llama"], tmp_path / "ones", self_attn_scales({0: (1.0, 1.0), 1: (1.0, 1.0)}))
    assert _runner(ones).kv_scales_digest == plain == scales_digest([], 2)
    scaled = with_kv_scales(tiny_model_dirs["llama"], tmp_path / "scaled", self_attn_scales({0: (1.0, 1.0),
                                                                                            1: (1.0, 0.999)}))
    assert _runner(scaled).kv_scales_digest not in (plain, "")
