"""Weight quantization on a GPU (``pytest -m gpu tests/gpu/test_quant_gpu.py``): the W4A16 / W8A16 Triton
kernels at Llama-3-8B projection shapes against dequantize-then-matmul, the FP8 matmul (per-token
activations, torch._scaled_mm) against the dequantized reference, and whole models in each quantization
generating the CPU reference's tokens; the repacked W4 kernel (kernels/triton/w4_fast.py) the same way.
tests/kernels/test_quant_interpret.py and test_w4_fast_interpret.py run the kernel checks at small shapes
on CPU.
"""

import pytest
import torch

from kvrelay.kernels import quant
from tests.kernels.quant_cases import check_int8, check_w4, check_w4_packed, w4_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
# Llama-3-8B: qkv, o, gate|up, down (K, N)
SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]


@pytest.fixture(scope="module")
def kernel():
    pytest.importorskip("triton")
    from kvrelay.kernels.triton import w4a16

    return w4a16


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("rows", [1, 4, 256, 1000])
def test_w4_real_shapes(kernel, k, n, rows):
    check_w4(kernel, "cuda", rows, k, n, 128, torch.bfloat16, act_order=False)


@pytest.mark.parametrize("rows", [1, 300])
def test_w4_act_order(kernel, rows):
    check_w4(kernel, "cuda", rows, 4096, 4096, 128, torch.float16, act_order=True, bias=True)


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("rows", [1, 4, 256, 1000])
def test_w4_repacked_real_shapes(k, n, rows):
    # kernels/triton/w4_fast.py: the default configuration splits K at these shapes for few rows
    pytest.importorskip("triton")
    from kvrelay.kernels.triton import w4_fast

    check_w4_packed(w4_fast, "cuda", rows, k, n, 128, torch.bfloat16, "awq")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 300])
def test_w4_repacked_act_order(dtype, rows):
    pytest.importorskip("triton")
    from kvrelay.kernels.triton import w4_fast

    check_w4_packed(w4_fast, "cuda", rows, 4096, 4096, 128, dtype, "gptq_act_order", bias=True)


@pytest.mark.parametrize("split", [1, 4, 16])
def test_w4_repacked_split_k_gives_the_same_bits_every_call(split):
    # the splits' partial sums are added in a fixed order (kernels/triton/w4_fast.py), not by atomics;
    # fp32 activations and outputs, so no rounding to bf16 could hide an order that changed
    pytest.importorskip("triton")
    from kvrelay.kernels.triton import w4_fast
    from kvrelay.kernels.w4_repack import repack_w4

    q, zeros, scales, _, x, _ = w4_case(16, 14336, 4096, 128, torch.float32, False, False)
    packed = repack_w4(quant.pack_w4(q).cuda(), zeros.cuda(), scales.cuda(), 128)
    first = w4_fast.w4_packed_linear(x.cuda(), packed, cfg=(16, 64, split))
    for _ in range(5):
        assert torch.equal(w4_fast.w4_packed_linear(x.cuda(), packed, cfg=(16, 64, split)), first)


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("rows", [1, 4, 256])  # the skinny loop, the GEMV, the GEMM
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_int8_real_shapes(kernel, k, n, rows, kind):
    check_int8(kernel, "cuda", rows, k, n, torch.bfloat16, kind=kind)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 tensor cores need compute capability 8.9")
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("rows", [1, 7, 512])
def test_fp8_scaled_mm(k, n, rows):
    from kvrelay.kernels.triton.fp8_linear import fp8_linear

    gen = torch.Generator().manual_seed(k + n + rows)
    weight, scale = quant.quantize_channel(torch.randn(n, k, generator=gen) / k ** 0.5, "fp8")
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    got = fp8_linear(x.cuda(), weight.cuda(), scale.cuda(), bias.cuda()).float().cpu()
    # one row reads the weight only (kernels/triton/skinny_linear.py); more take the tensor cores
    expected = (quant.fp8_linear if rows == 1 else quant.fp8_linear_w8a8)(x.float(), weight, scale, bias.float())
    # the same arithmetic: what is left is bf16 output rounding and, rarely, an activation on a rounding tie
    # landing one e4m3 step the other way; measured against the output's scale
    err = (got - expected).abs().max() / expected.abs().max()
    assert err < 0.01, err
    # against the weight-only (W8A16) reference, per-token rounding of the activations shows: ~2% per product,
    # averaging down over K
    assert (got - quant.fp8_linear(x.float(), weight, scale, bias.float())).abs().max() / expected.abs().max() < 0.03


@pytest.mark.parametrize("rows, k", [(1, 4096), (300, 14336), (5, 100)])
def test_per_token_fp8_quantization(rows, k):
    # the Triton kernel against kernels/quant.py's torch form: the same scales and fp8 values (both round to
    # nearest even; the GPU's fp32 division may differ in the last bit, flipping a rare tie by one fp8 step).
    # Not under the CPU interpreter, whose fp8 conversion is wrong
    from kvrelay.kernels.triton.fp8_quant import quantize_per_token_fp8

    gen = torch.Generator().manual_seed(rows * k)  # the same values every run: a mismatch is reproducible
    x = (torch.randn(rows, k, generator=gen) * torch.logspace(-3, 3, rows)[:, None]).to(torch.bfloat16)
    q, scale = quantize_per_token_fp8(x.cuda())
    q_ref, scale_ref = quant.quantize_per_token_fp8(x)
    torch.testing.assert_close(scale.cpu(), scale_ref)
    got, want = q.cpu().float(), q_ref.float()
    torch.testing.assert_close(got, want, rtol=0.125, atol=2.0 ** -9)  # at most one e4m3 step apart
    assert (got != want).float().mean() < 1e-3


@pytest.mark.parametrize("method", ["fp8", "int8", "awq", "gptq"])
def test_models_generate_the_cpu_references_tokens(tiny_model_dirs, tmp_path, method, monkeypatch):
    """A quantized tiny model in fp32 on the GPU (Triton / cuBLAS) and on the CPU (the references): the
    same greedy tokens. fp8 on the GPU quantizes activations too, so its CPU run takes that arithmetic's
    reference (kernels/quant.py ``fp8_linear_w8a8``) in place of the CPU's weight-only one."""
    from kvrelay import LLM, SamplingParams
    from kvrelay.kernels import reference
    from kvrelay.shared.engine.quant.checkpoint import quantize_checkpoint

    if method == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9")
    ckpt = quantize_checkpoint(tiny_model_dirs["llama"], tmp_path / method, method, group_size=32)
    prompts = [{"prompt_token_ids": [5, 17, 33, 99, 3]}, {"prompt_token_ids": list(range(10, 60))}]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    if method == "fp8":
        monkeypatch.setattr(reference, "fp8_linear", quant.fp8_linear_w8a8)
    cpu_llm = LLM(model=str(ckpt), device="cpu", dtype="float32")
    # two prompts: graphs for batches 1, 2 and 4 are all the decode steps take (the default 256 would capture,
    # and compile the quantized kernels for, 23 batch sizes that never run here)
    gpu = LLM(model=str(ckpt), device="cuda", dtype="float32", num_gpu_blocks=256,
              max_num_seqs=4).generate(prompts, params)
    if method != "fp8":
        cpu = cpu_llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in cpu]
        return
    # W8A8 rounds every activation to e4m3 per token: cuBLASLt's and torch's sums in another order can put a
    # value on the other side of a rounding tie, and this random model's logits are close together, so the
    # greedy paths may part at a near-tie. Teacher-forced on the GPU's tokens, each must be the CPU
    # reference's choice or within `tie` nats of it: far below what the arithmetic itself moves on this model
    # (W8A16's tokens sit up to 0.36 nats off W8A8's choice on the CPU), so a GPU on another path fails.
    tie = 0.1
    for prompt, out in zip(prompts, gpu, strict=True):
        seq = prompt["prompt_token_ids"] + list(out.outputs[0].token_ids)
        ref = cpu_llm.generate([{"prompt_token_ids": seq}],
                               SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))[0]
        for j in range(len(prompt["prompt_token_ids"]), len(seq)):
            ranked = ref.prompt_logprobs[j]
            best = max(v.logprob for v in ranked.values())
            assert best - ranked[seq[j]].logprob <= tie, (j, seq[j], ranked)


@pytest.mark.parametrize("method", ["fp8", "int8", "awq"])
def test_dummy_llama_3_8b_shape_runs(method, monkeypatch):
    from kvrelay import LLM, SamplingParams
    from kvrelay.shared.config import presets

    if method == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9")
    # every layer of Llama-3-8B has the same shapes, so two of them run each quantized projection at its real
    # shape (with the real vocabulary and heads): the other 30 only repeated them. Eight sequences at most, not
    # 256: the decode graphs of batches 1, 2, 4 and 8 (for awq both its decode GEMV and w4_fast), not 23 buckets
    real = presets.PRESETS["llama-3-8b"]
    monkeypatch.setitem(presets.PRESETS, "llama-3-8b-2-layers", {**real, "num_hidden_layers": 2})
    llm = LLM(model="dummy:llama-3-8b-2-layers", quantization=method, max_model_len=1024, num_gpu_blocks=512,
              max_num_seqs=8)
    assert llm.engine.core.runner.model.num_layers == 2
    out = llm.generate([{"prompt_token_ids": list(range(100, 600))}] * 3,
                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)


@pytest.mark.parametrize("k, rows", [(4096, 300), (14336, 37)])
def test_fp8_prologues_write_the_unfused_bytes(k, rows):
    # the norm and SiLU*mul that quantize their own rows (kernels/triton/fp8_prologue.py) against the kernels they
    # fuse, one after the other: the same e4m3 bytes and scales; the matmuls behind them then give the same bits
    from kvrelay.kernels.triton import fp8_prologue
    from kvrelay.kernels.triton.fp8_linear import fp8_linear, rms_norm_fp8_linear, silu_mul_fp8_linear
    from kvrelay.kernels.triton.fp8_quant import quantize_per_token_fp8
    from kvrelay.kernels.triton.rms_norm import rms_norm
    from kvrelay.kernels.triton.silu_mul import silu_mul

    gen = torch.Generator().manual_seed(k + rows)
    x, res, gate_up = (torch.randn(rows, n, generator=gen).mul(torch.logspace(-2, 2, rows)[:, None])
                       .to(torch.bfloat16).cuda() for n in (k, k, 2 * k))
    norm_w = (1 + torch.randn(k, generator=gen) / 4).to(torch.bfloat16).cuda()
    weight, scale = quant.quantize_channel(torch.randn(512, k, generator=gen).cuda() / k ** 0.5, "fp8")
    q, s, r = fp8_prologue.rms_norm_fp8(x, norm_w, 1e-5, res)
    normed, r_ref = rms_norm(x, norm_w, 1e-5, res)
    q_ref, s_ref = quantize_per_token_fp8(normed)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(r, r_ref)
    q, s = fp8_prologue.silu_mul_fp8(gate_up[:, :2 * k])
    q_ref, s_ref = quantize_per_token_fp8(silu_mul(gate_up[:, :2 * k]))
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    y, r = rms_norm_fp8_linear(x, res, norm_w, 1e-5, weight, scale)
    assert torch.equal(y, fp8_linear(normed, weight, scale)) and torch.equal(r, r_ref)
    w2, s2 = quant.quantize_channel(torch.randn(512, k, generator=gen).cuda() / k ** 0.5, "fp8")
    assert torch.equal(silu_mul_fp8_linear(gate_up, w2, s2), fp8_linear(silu_mul(gate_up), w2, s2))


def test_fp8_model_runs_the_fused_prologues(monkeypatch):
    # a bf16 model in fp8: its prefill and its batched decode steps take the quantizing norm and SiLU*mul, and
    # generate what the unfused ops generate. Eager, so the second run's steps are not graphs captured fused
    # (test_dummy_llama_3_8b_shape_runs runs them under graphs)
    from kvrelay import LLM, SamplingParams
    from kvrelay.kernels.triton import fp8_prologue
    from kvrelay.shared.config import presets

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9")
    real = presets.PRESETS["llama-3-8b"]
    monkeypatch.setitem(presets.PRESETS, "llama-3-8b-2-layers", {**real, "num_hidden_layers": 2})
    calls = {"norm": 0, "silu": 0}
    for name, op in (("norm", fp8_prologue.rms_norm_fp8), ("silu", fp8_prologue.silu_mul_fp8)):
        def counted(*a, _op=op, _name=name, **kw):
            calls[_name] += 1
            return _op(*a, **kw)
        monkeypatch.setattr(fp8_prologue, {"norm": "rms_norm_fp8", "silu": "silu_mul_fp8"}[name], counted)
    llm = LLM(model="dummy:llama-3-8b-2-layers", quantization="fp8", max_model_len=1024, num_gpu_blocks=512,
              max_num_seqs=4, enforce_eager=True)
    prompts = [{"prompt_token_ids": list(range(100 + i, 400 + 37 * i))} for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    fused = llm.generate(prompts, params)
    assert calls["norm"] and calls["silu"]
    monkeypatch.setattr(fp8_prologue, "fits", lambda x, cols: False)
    unfused = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in fused] == [o.outputs[0].token_ids for o in unfused]
