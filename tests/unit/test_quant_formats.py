"""The published quantized layouts against references written here from each format's description, and
the one-line errors for quantizations that cannot run.

AutoAWQ GEMM (its ``WQLinear_GEMM.from_linear``): ``intweight`` [K, N]; for each output column block c and
slot i in 0..7, ``qweight[:, c] |= intweight[:, 8c + order[i]] << 4i`` with order 0 2 4 6 1 3 5 7; the
zero points pack the same way; ``w = (q - z) * s`` per group of G inputs.
GPTQ (AutoGPTQ's ``QuantLinear.pack``): ``qweight[r, n] |= q[8r + j, n] << 4j``; ``qzeros[g, c] |=
(z[g, 8c + j] - 1) << 4j``; the input k belongs to group ``g_idx[k]``.
"""

import pytest
import torch

from kvrelay.kernels import quant as kq
from kvrelay.kernels import w4_repack
from kvrelay.kernels.w4_repack import act_order_perm
from kvrelay.shared.engine.quant import config as qc
from kvrelay.shared.engine.quant import formats
from kvrelay.shared.engine.quant import linear as quant_linear
from kvrelay.shared.engine.quant.config import QuantConfig
from kvrelay.shared.engine.quant.linear import W4Linear

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def awq_pack_reference(intweight: torch.Tensor) -> torch.Tensor:
    rows, cols = intweight.shape
    out = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for c in range(cols // 8):
        for i in range(8):
            out[:, c] |= intweight[:, c * 8 + ORDER[i]].long() << (4 * i)
    return _as_int32(out)


def gptq_pack_rows_reference(q: torch.Tensor) -> torch.Tensor:
    k, n = q.shape
    out = torch.zeros(k // 8, n, dtype=torch.int64)
    for r in range(k // 8):
        for j in range(8):
            out[r] |= q[8 * r + j].long() << (4 * j)
    return _as_int32(out)


def gptq_pack_zeros_reference(z: torch.Tensor) -> torch.Tensor:
    groups, n = z.shape
    out = torch.zeros(groups, n // 8, dtype=torch.int64)
    for c in range(n // 8):
        for j in range(8):
            out[:, c] |= ((z[:, 8 * c + j].long() - 1) & 0xF) << (4 * j)
    return _as_int32(out)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    # the 32 bits as a signed int32, as numpy's uint32 -> int32 view in the published packers gives
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def dequant_reference(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    # [N, K]: element by element, w[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]
    k, n = q.shape
    w = torch.empty(n, k)
    for kk in range(k):
        g = int(g_idx[kk])
        w[:, kk] = (q[kk].float() - z[g].float()) * s[g].float()
    return w


def _random_w4(k: int, n: int, group: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 16, (k // group, n), generator=gen)
    s = (torch.rand(k // group, n, generator=gen) * 0.05 + 0.001).half()
    return q, z, s


def _load(layer: W4Linear, tensors: dict[str, torch.Tensor]) -> None:
    for suffix, t in tensors.items():
        param, rows, convert = layer.route(suffix, None)
        param.data.copy_(convert(t) if convert else t)


@pytest.mark.parametrize("k, n, group", [(64, 32, 32), (128, 48, 64)])
def test_awq_layout_round_trip(k, n, group):
    q, z, s = _random_w4(k, n, group, seed=k + n)
    published = {"qweight": awq_pack_reference(q), "qzeros": awq_pack_reference(z), "scales": s}
    ours = formats.to_awq(q, z, s)
    assert torch.equal(ours["qweight"], published["qweight"]) and torch.equal(ours["qzeros"], published["qzeros"])
    layer = W4Linear(k, n, False, torch.float32, QuantConfig("awq", True, group))
    _load(layer, published)
    expected = dequant_reference(q, z, s, torch.arange(k) // group)
    got = layer.dequantize()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_layout_round_trip(act_order):
    k, n, group = 128, 40, 32
    q, z, s = _random_w4(k, n, group, seed=7)
    gen = torch.Generator().manual_seed(3)
    g_idx = (torch.randperm(k, generator=gen) // group if act_order else torch.arange(k) // group).to(torch.int32)
    published = {"qweight": gptq_pack_rows_reference(q), "qzeros": gptq_pack_zeros_reference(z), "scales": s,
                 "g_idx": g_idx}
    if not act_order:
        ours = formats.to_gptq(q, z, s, group)
        assert torch.equal(ours["qweight"], published["qweight"]) and torch.equal(ours["qzeros"], published["qzeros"])
    layer = W4Linear(k, n, False, torch.float32, QuantConfig("gptq", True, group, desc_act=act_order))
    _load(layer, published)
    expected = dequant_reference(q, z, s, g_idx)
    torch.testing.assert_close(layer.dequantize(), expected, rtol=0, atol=0)  # act-order: the plain layout
    layer.finish_loading(mapped=False)  # act-order: rows sorted into whole groups, for the repacked kernel
    assert layer.packed() is not None and (layer.perm is not None) == act_order
    torch.testing.assert_close(layer.dequantize(), expected, rtol=0, atol=0)


def test_gptq_act_order_derives_its_order_once_and_sorts_as_repack_w4_does(monkeypatch):
    k, n, group = 128, 40, 32
    q, z, s = _random_w4(k, n, group, seed=11)
    g_idx = (torch.randperm(k, generator=torch.Generator().manual_seed(2)) // group).to(torch.int32)
    layer = W4Linear(k, n, False, torch.float32, QuantConfig("gptq", True, group, desc_act=True))
    _load(layer, {"qweight": gptq_pack_rows_reference(q), "qzeros": gptq_pack_zeros_reference(z), "scales": s,
                  "g_idx": g_idx})
    expected = w4_repack.repack_w4(layer.qweight.clone(), layer.qzeros, layer.scales, group, g_idx)
    derived = []

    def counted(*args):
        derived.append(args)
        return act_order_perm(*args)

    monkeypatch.setattr(w4_repack, "act_order_perm", counted)
    monkeypatch.setattr(quant_linear, "act_order_perm", counted)
    layer.finish_loading(mapped=False)
    assert len(derived) == 1  # an argsort of K inputs, and its check, per layer at load
    assert torch.equal(layer.qweight, expected.qweight) and torch.equal(layer.perm, expected.perm)


def test_gptq_act_order_mapped_from_an_arena_derives_the_same_order_and_writes_nothing():
    k, n, group = 128, 40, 32
    q, z, s = _random_w4(k, n, group, seed=5)
    g_idx = (torch.randperm(k, generator=torch.Generator().manual_seed(1)) // group).to(torch.int32)
    published = {"qweight": gptq_pack_rows_reference(q), "qzeros": gptq_pack_zeros_reference(z), "scales": s,
                 "g_idx": g_idx}
    config = QuantConfig("gptq", True, group, desc_act=True)
    exporter, importer = W4Linear(k, n, False, torch.float32, config), W4Linear(k, n, False, torch.float32, config)
    _load(exporter, published)
    exporter.finish_loading(mapped=False)
    importer.load_state_dict(exporter.state_dict())  # the arena's bytes, as the exporter left them
    written = importer.qweight.clone()
    importer.finish_loading(mapped=True)
    assert torch.equal(importer.qweight, written) and torch.equal(importer.perm, exporter.perm)
    torch.testing.assert_close(importer.dequantize(), dequant_reference(q, z, s, g_idx), rtol=0, atol=0)


def test_gptq_g_idx_scattering_a_group_keeps_the_plain_layout():
    k, n, group = 64, 16, 32
    q, z, s = _random_w4(k, n, group, seed=9)
    g_idx = torch.tensor([0] * 40 + [1] * 24, dtype=torch.int32)  # group 0 holds 40 inputs
    layer = W4Linear(k, n, False, torch.float32, QuantConfig("gptq", True, group, desc_act=True))
    _load(layer, {"qweight": gptq_pack_rows_reference(q), "qzeros": gptq_pack_zeros_reference(z), "scales": s,
                  "g_idx": g_idx})
    layer.finish_loading(mapped=False)
    assert layer.packed() is None and layer.perm is None
    torch.testing.assert_close(layer.dequantize(), dequant_reference(q, z, s, g_idx), rtol=0, atol=0)


def test_rtn_quantizer_beats_plain_min_max_rounding():
    # plain round-to-nearest over each group's [min, max] (AutoAWQ's pseudo_quantize_tensor without its
    # search): the quantizer's range search includes it, so it can only do better
    w = torch.randn(24, 64)
    wg = w.t().reshape(2, 32, 24)
    lo, hi = wg.amin(1), wg.amax(1)
    s = ((hi - lo) / 15).half().float()
    z = (-lo / s).round().clamp(0, 15)
    plain = ((((wg / s[:, None]).round() + z[:, None]).clamp(0, 15) - z[:, None]) * s[:, None]).reshape(64, 24).t()
    q, zeros, scales = formats.rtn_w4(w, 32)
    ours = dequant_reference(q, zeros, scales, torch.arange(64) // 32)
    assert (ours - w).pow(2).sum() <= (plain - w).pow(2).sum()
    assert ((ours - w).abs() <= scales.float().repeat_interleave(32, 0).t() * 1.06).all()  # within a step


@pytest.mark.parametrize("kind, top", [("int8", 127.0), ("fp8", 448.0)])
def test_per_channel_quantization(kind, top):
    w = torch.randn(16, 96) * torch.linspace(0.01, 3, 16)[:, None]
    w[3] = 0  # a zero row stays zero, not NaN
    q, scale = kq.quantize_channel(w, kind)
    assert q.dtype == (torch.int8 if kind == "int8" else torch.float8_e4m3fn)
    torch.testing.assert_close(q.float().abs().amax(1)[torch.arange(16) != 3], torch.full((15,), top))
    deq = kq.dequantize_channel(q, scale)
    assert torch.equal(deq[3], torch.zeros(96))
    if kind == "int8":  # uniform steps of one scale: at most half a step off
        assert ((deq - w).abs() <= scale[:, None] / 2 + 1e-6).all()
    else:  # e4m3 keeps 3 mantissa bits: at most 1/16 relative off, or half the smallest subnormal step
        assert ((deq - w).abs() <= w.abs() / 16 + scale[:, None] * 2.0 ** -10).all()


def test_per_token_activation_scales():
    x = torch.randn(5, 64) * torch.tensor([0.01, 1, 10, 100, 1000])[:, None]
    xq, scale = kq.quantize_per_token_fp8(x)
    assert scale.shape == (5, 1)
    torch.testing.assert_close(xq.float() * scale, x, rtol=1 / 16, atol=0)


CHECKPOINT_CONFIGS = [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}, "awq"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "sym": True}, "gptq"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}, "targets": ["Linear"]}}}, "fp8"),
]


@pytest.mark.parametrize("config, method", CHECKPOINT_CONFIGS)
def test_detected_from_the_checkpoint(config, method):
    found = qc.resolve(None, {"quantization_config": config}, torch.device("cpu"))
    assert found.method == method and found.prequantized
    if method == "gptq":
        assert found.desc_act and found.group_size == 64


@pytest.mark.parametrize("requested, config, message", [
    ("int8", CHECKPOINT_CONFIGS[0][0], "quantization int8 does not match the checkpoint, which is quantized with awq"),
    ("awq", None, "quantization awq needs a checkpoint quantized with awq"),
    (None, {"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq with 3 bits; only 4 is supported"),
    (None, {"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise FP8"),
    (None, {"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    (None, {"quant_method": "awq", "bits": 4, "group_size": -1}, "group_size -1"),
])
def test_unrunnable_quantizations_fail_in_one_line(requested, config, message):
    with pytest.raises(ValueError, match=message) as err:
        qc.resolve(requested, {"quantization_config": config} if config else {}, torch.device("cpu"))
    assert "\n" not in str(err.value)


def test_group_size_must_divide_the_projection():
    with pytest.raises(ValueError, match="awq group size 48 does not fit a 64 -> 32 projection"):
        W4Linear(64, 32, False, torch.float32, QuantConfig("awq", True, 48))
