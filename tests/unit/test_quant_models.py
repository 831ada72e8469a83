"""A tiny model quantized each way gives the same greedy tokens as the same model whose projection
weights are the quantized values, dequantized, in an fp32 checkpoint: so loading (fused q|k|v and
gate|up parts, GPT-2's transposed Conv1D, BLOOM's regrouped qkv, the published 4-bit layouts) and the
quantized matmuls change nothing but the weights' precision. Also: the quantized model holds fewer
bytes, and a checkpoint whose layout contradicts its config fails with one line.
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvrelay import LLM, SamplingParams
from kvrelay.kernels import quant as kq
from kvrelay.shared.engine.quant import formats
from kvrelay.shared.engine.quant.checkpoint import quantize_checkpoint
from kvrelay.shared.engine.quant.linear import W4Linear
from tests.unit.act_order_checkpoints import write_act_order_gptq

GROUP = 32  # divides the tiny models' 64 and 128 inputs
PROJECTIONS = {
    "llama": re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$"),
    "gpt2": re.compile(r"^transformer\.h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$"),
    "bloom": re.compile(r"^transformer\.h\.\d+\.(self_attention\.(query_key_value|dense)|mlp\.dense_(h_to_4h|4h_to_h))"
                        r"\.weight$"),
}
PROMPTS = [{"prompt_token_ids": [5, 17, 33, 99, 3]}, {"prompt_token_ids": [400, 2, 77]},
           {"prompt_token_ids": list(range(10, 40))}]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def dequantized(w: torch.Tensor, method: str) -> torch.Tensor:
    """A [N, K] weight as the quantized model holds it, dequantized to fp32."""
    if method in ("int8", "fp8"):
        return kq.dequantize_channel(*kq.quantize_channel(w, method))
    q, zeros, scales = formats.rtn_w4(w, GROUP)
    g = torch.arange(w.shape[1]) // GROUP
    return ((q.float() - zeros[g].float()) * scales[g].float()).t()


def write_dequantized(src: Path, dst: Path, arch: str, method: str) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    for name, t in tensors.items():
        if PROJECTIONS[arch].match(name):
            conv1d = arch == "gpt2"  # stored [in, out]
            w = dequantized(t.t() if conv1d else t, method)
            tensors[name] = (w.t() if conv1d else w).contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def greedy(path: Path, **kw) -> list[list[int]]:
    llm = LLM(model=str(path), kv_cache_memory=1 << 22, **kw)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]


def weight_bytes(path: Path, **kw) -> int:
    llm = LLM(model=str(path), kv_cache_memory=1 << 22, **kw)
    return llm.engine.core.weight_bytes


@pytest.mark.parametrize("arch, method", [("llama", "int8"), ("llama", "fp8"), ("gpt2", "int8"), ("bloom", "fp8")])
def test_quantized_as_it_loads(tiny_model_dirs, tmp_path, arch, method):
    src = tiny_model_dirs[arch]
    reference = greedy(write_dequantized(src, tmp_path / "deq", arch, method))
    assert greedy(src, quantization=method) == reference
    assert weight_bytes(src, quantization=method) < weight_bytes(src)  # really quantized, not a no-op


@pytest.mark.parametrize("method", ["fp8", "int8", "awq", "gptq"])
def test_quantized_checkpoint(tiny_model_dirs, tmp_path, method):
    src = tiny_model_dirs["qwen2"]  # q|k|v biases stay full precision beside quantized weights
    ckpt = quantize_checkpoint(src, tmp_path / method, method, group_size=GROUP)
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"]
    reference = greedy(write_dequantized(src, tmp_path / "deq", "llama", method))
    assert greedy(ckpt) == reference  # detected from config.json
    assert greedy(ckpt, quantization=method) == reference
    assert weight_bytes(ckpt) < weight_bytes(src)


def test_gptq_act_order_checkpoint_runs_the_repacked_kernel(tiny_model_dirs, tmp_path):
    """GPTQ's act-order: the rows are sorted into whole groups once loaded, for the repacked kernel."""
    ckpt, deq = write_act_order_gptq(tiny_model_dirs["llama"], tmp_path, GROUP)
    llm = LLM(model=str(ckpt), kv_cache_memory=1 << 22)
    layers = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, W4Linear)]
    assert layers and all(m.packed() is not None and m.perm is not None for m in layers)
    assert [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)] == greedy(deq)


def test_checkpoint_layout_contradicting_its_config(tiny_model_dirs, tmp_path):
    ckpt = quantize_checkpoint(tiny_model_dirs["llama"], tmp_path / "awq", "awq", group_size=GROUP)
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"]["group_size"] = 64  # the tensors hold groups of 32
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"shape mismatch for tensor 'model\.layers\.0\..*qzeros'.*awq layout"):
        LLM(model=str(ckpt), kv_cache_memory=1 << 22)
    config["quantization_config"]["group_size"] = 48  # divides nothing here
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="awq group size 48 does not fit a 64 -> 128 projection"):
        LLM(model=str(ckpt), kv_cache_memory=1 << 22)


def test_four_bit_models_need_a_four_bit_checkpoint(tiny_model_dirs):
    with pytest.raises(ValueError, match="quantization gptq needs a checkpoint quantized with gptq"):
        LLM(model=str(tiny_model_dirs["llama"]), quantization="gptq")
    with pytest.raises(ValueError, match="GPT2LMHeadModel supports quantization int8 and fp8"):
        LLM(model="dummy:tiny-gpt2", quantization="awq")


def test_fp8_checkpoint_with_per_tensor_scales(tiny_model_dirs, tmp_path):
    """AutoFP8's layout (quant_method fp8): one scalar weight_scale per projection, which the fused q|k|v and
    gate|up rows each keep as their own, and static input scales, which per-token scaling replaces."""
    src = tiny_model_dirs["llama"]
    fp8, deq = tmp_path / "fp8", tmp_path / "deq"
    shutil.copytree(src, fp8)
    shutil.copytree(src, deq)
    tensors, quantized, dequantized = load_file(str(src / "model.safetensors")), {}, {}
    for name, t in tensors.items():
        if not PROJECTIONS["llama"].match(name):
            quantized[name] = dequantized[name] = t
            continue
        scale = t.abs().max() / 448
        q = (t / scale).to(torch.float8_e4m3fn)
        prefix = name.removesuffix(".weight")
        quantized |= {name: q, f"{prefix}.weight_scale": scale.reshape(()),
                      f"{prefix}.input_scale": torch.tensor(1.0)}
        dequantized[name] = q.float() * scale
    save_file(quantized, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(deq / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (fp8 / "config.json").write_text(json.dumps(config))
    assert greedy(fp8) == greedy(deq)
