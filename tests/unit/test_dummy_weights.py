"""Dummy weights are a pure function of (seed, parameter name, element index) (shared/engine/dummy_weights.py):
the int64 hash matches true unsigned 64-bit splitmix64, values do not depend on the chunking, parameters of
one shape differ, the spread is N(0, 0.02)'s, a bf16 model holds the float32 model's values rounded, two
loads agree bit for bit, a pipeline stage holds the whole model's values for its layers, and an int8 or fp8
projection holds the unquantized model's weight, quantized."""

import pytest
import torch

from kvrelay.kernels.quant import quantize_channel
from kvrelay.shared.config.engine import ModelConfig
from kvrelay.shared.engine import dummy_weights
from kvrelay.shared.engine.dummy_weights import fill_bits_, fill_normal_, stream_key
from kvrelay.shared.engine.loader import load_model
from kvrelay.shared.engine.parallel.pipeline import MissingLayer
from kvrelay.shared.engine.quant.linear import QuantLinear

M64 = (1 << 64) - 1


def splitmix64(key: int, index: int) -> int:
    """The reference, in Python's unbounded ints: no sign, no wrapping surprises."""
    x = (index * 0x9E3779B97F4A7C15 + key) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def test_int64_hashes_match_unsigned_splitmix64():
    key = stream_key(0, "model.layers.0.mlp.up_proj.weight")
    start = (1 << 62) - 3  # indices whose products overflow, and hashes with the top bit set
    got = dummy_weights._hashes(key, start, start + 64, torch.device("cpu")).tolist()
    assert [g & M64 for g in got] == [splitmix64(key, i) for i in range(start, start + 64)]
    assert any(g < 0 for g in got)  # negative int64s were among them: the logical shifts were exercised


@pytest.mark.parametrize("chunk", [1, 4097, 1 << 16, 1 << 24])
def test_values_do_not_depend_on_the_chunk_size(chunk):
    shape = (37, 129) if chunk == 1 else (300, 1001)  # one element a pass: a small tensor
    whole = fill_normal_(torch.empty(shape), 3, "w", 0.02, chunk=1 << 24)
    assert torch.equal(fill_normal_(torch.empty(shape), 3, "w", 0.02, chunk=chunk), whole)
    bits = fill_bits_(torch.empty(shape, dtype=torch.int32), 3, "q", chunk=1 << 24)
    assert torch.equal(fill_bits_(torch.empty(shape, dtype=torch.int32), 3, "q", chunk=chunk), bits)


def test_streams_differ_by_name_and_seed_and_repeat_otherwise():
    def draw(seed, name):
        return fill_normal_(torch.empty(64, 64), seed, name, 0.02)
    a = draw(0, "model.layers.0.self_attn.o_proj.weight")
    assert torch.equal(a, draw(0, "model.layers.0.self_attn.o_proj.weight"))
    for other in (draw(0, "model.layers.1.self_attn.o_proj.weight"), draw(1, "model.layers.0.self_attn.o_proj.weight")):
        assert (other != a).float().mean() > 0.99


def test_spread_is_that_of_the_asked_normal():
    w = fill_normal_(torch.empty(1 << 20), 0, "w", 0.02)
    assert abs(w.mean().item()) < 1e-4
    assert w.std().item() == pytest.approx(0.02, rel=0.01)
    assert w.abs().max().item() <= 0.02 * 3.47  # Irwin-Hall of four: bounded at sqrt(12) std
    assert ((w.abs() < 0.02).float().mean().item()) == pytest.approx(0.683, abs=0.02)  # bell, not flat (0.577)
    bits = fill_bits_(torch.empty(1 << 20, dtype=torch.int32), 0, "q")
    nibbles = torch.stack([(bits >> s) & 15 for s in range(0, 32, 4)]).flatten()
    assert torch.bincount(nibbles, minlength=16).float().div(nibbles.numel()).sub(1 / 16).abs().max() < 1e-3


def dummy(dtype: str, **kw) -> torch.nn.Module:
    return load_model(ModelConfig("dummy:tiny-llama", load_format="dummy", dtype=dtype, seed=5), "cpu", **kw)[0]


def test_a_model_is_the_same_on_every_load_and_in_bf16_the_float32_values_rounded():
    first, again, half = dummy("float32"), dummy("float32"), dummy("bfloat16")
    params = dict(first.named_parameters())
    assert params.keys() == dict(half.named_parameters()).keys()
    for name, p in again.named_parameters():
        assert torch.equal(p, params[name]), name
    for name, p in half.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, params[name].to(torch.bfloat16)), name
    matrices = [p for p in params.values() if p.dim() == 2]
    alike = [(a, b) for i, a in enumerate(matrices) for b in matrices[i + 1:] if a.shape == b.shape]
    assert alike and not any(torch.equal(a, b) for a, b in alike)  # each layer's projections: their own values


def test_a_pipeline_stage_holds_the_whole_models_values():
    whole = dict(dummy("float32").named_parameters())
    last = dummy("float32", pipeline=(1, 2))
    held = [(name, p) for name, p in last.named_parameters() if ".layers.1." in name]
    assert held and not isinstance(last.decoder_layers()[1], MissingLayer)
    for name, p in held:
        assert torch.equal(p, whole[name]), name


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_projections_quantize_the_unquantized_models_weights(method):
    model = load_model(ModelConfig("dummy:tiny-llama", load_format="dummy", dtype="bfloat16", seed=5,
                                   quantization=method), "cpu")[0]
    dense = dict(dummy("bfloat16").named_parameters())
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert layers
    for name, layer in layers.items():  # the unquantized model's weight, quantized
        expected = quantize_channel(dense[f"{name}.weight"], method)[0]
        assert torch.equal(layer.weight.view(torch.int8), expected.view(torch.int8)), name
