"""The half2 decode GEMV on a GPU (``pytest -m gpu tests/gpu/test_w4_gemv_h2_gpu.py``): kernels/triton/w4_gemv_h2.py
at Llama-3-8B projection shapes against dequantize-then-matmul (AWQ, GPTQ with act-order, groups of 32, 64 and 128,
ragged outputs, bias), activations large enough that unscaled fp16 sums would overflow, the tile shapes the sweep
tries, a CUDA-graph replay, and a quantized model decoding one row at a time under it and under the fp32 atomic
GEMV to the same tokens.
tests/kernels/test_w4_gemv_h2_interpret.py runs the kernel on the host with its PTX emulated.
"""

import pytest
import torch

from kvrelay.kernels import quant
from tests.kernels.quant_cases import check_w4_packed, full_fp32, w4_case
from tests.kernels.triton_cases import TOL

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # Llama-3-8B: qkv, o, gate|up, down (K, N)


@pytest.fixture
def h2(monkeypatch):
    """check_w4_packed's stand-in module running w4_gemv_h2_linear, with w4_gemv's GEMV (the wrapper's fallback)
    refused: every call here must run the half2 kernel."""
    from kvrelay.kernels.triton import w4_gemv, w4_gemv_h2

    def refuse(*args, **kwargs):
        raise AssertionError("w4_gemv_h2_linear fell back to w4_gemv")

    monkeypatch.setattr(w4_gemv, "w4_gemv_linear", refuse)
    return type("H2", (), {"w4_packed_linear": staticmethod(w4_gemv_h2.w4_gemv_h2_linear)})


def packed_case(k: int, n: int, group: int = 128, bias: bool = False):
    """(the repacked weight, its q, zero points and scales on the GPU, bias or None) of w4_case's draw."""
    from kvrelay.kernels.w4_repack import repack_w4

    q, zeros, scales, _, _, b = w4_case(1, k, n, group, torch.bfloat16, False, bias)
    q, zeros, scales = q.cuda(), zeros.cuda(), scales.cuda()
    return repack_w4(quant.pack_w4(q), zeros, scales, group), q, zeros, scales, b.cuda() if bias else None


def reference(x: torch.Tensor, q, zeros, scales, bias, group: int = 128) -> torch.Tensor:
    with full_fp32():
        return quant.w4a16_linear(x.float(), quant.pack_w4(q), zeros, scales, group, None,
                                  bias.float() if bias is not None else None)


@pytest.mark.parametrize("k, n", SHAPES)
def test_real_shapes(h2, k, n):
    # the default configuration splits K at every one of these shapes: the atomic sum
    check_w4_packed(h2, "cuda", 1, k, n, 128, torch.bfloat16, "awq")


@pytest.mark.parametrize("source", ["awq", "gptq_act_order"])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_sources_and_groups(h2, source, group):
    check_w4_packed(h2, "cuda", 1, 4096, 4096, group, torch.bfloat16, source, bias=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_act_order_down(h2, dtype):
    # down's K, the longest sum, at fp16's tighter tolerance too
    check_w4_packed(h2, "cuda", 1, 14336, 4096, 128, dtype, "gptq_act_order", bias=True)


def test_ragged_outputs(h2):
    # 4,136 outputs: the last of five 1,024-column tiles holds 40
    check_w4_packed(h2, "cuda", 1, 4096, 4136, 128, torch.bfloat16, "w4_act_order", bias=True)


@pytest.mark.parametrize("cfg", [(1024, 8, 1, 4, 1), (512, 8, 0, 4, 1), (2048, 8, 0, 4, 1), (1024, 16, 0, 4, 1),
                                 (1024, 8, 0, 2, 1), (1024, 2, 0, 4, 1), (1024, 8, 4, 4, 3)])
def test_tile_shapes_the_sweep_tries(h2, cfg):
    # SPLIT 1: the bias in the kernel; BLOCK_R 2: halves of one packed row; 4 splits of 3 stages: chunks in flight
    check_w4_packed(h2, "cuda", 1, 14336, 4096, 128, torch.bfloat16, "gptq", bias=True, cfg=cfg)


def test_activations_whose_unscaled_fp16_sums_would_overflow(h2):
    # hundreds everywhere, and every 512th input +-30,000: one product of 30,000 by |q - z| >= 3 is past fp16's
    # 65,504 unless the activations are scaled down first. The tolerance scales with the activations
    p, q, zeros, scales, b = packed_case(14336, 4096, bias=True)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 14336, generator=gen) * 300
    x[0, ::512] = 30000 * torch.randn(28, generator=gen).sign()
    x = x.to(torch.bfloat16).cuda()
    got = h2.w4_packed_linear(x, p, b)
    expected = reference(x, q, zeros, scales, b)
    assert got.float().isfinite().all()
    tol = TOL[torch.bfloat16]
    torch.testing.assert_close(got.float(), expected, atol=tol * 300, rtol=tol)


def test_fp32_activations_run_w4_gemvs_gemv(monkeypatch):
    # fp16 products would not keep fp32's precision: the wrapper sends fp32 rows to w4_gemv's atomic GEMV
    from kvrelay.kernels.triton import w4_gemv, w4_gemv_h2

    calls = []
    real = w4_gemv.w4_gemv_linear
    monkeypatch.setattr(w4_gemv, "w4_gemv_linear", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    check_w4_packed(type("H2", (), {"w4_packed_linear": staticmethod(w4_gemv_h2.w4_gemv_h2_linear)}), "cuda", 1,
                    4096, 4096, 128, torch.float32, "awq")
    assert calls


def test_a_cuda_graph_replays_it(h2):
    p, q, zeros, scales, b = packed_case(4096, 6144, bias=True)
    x = torch.randn(1, 4096, device="cuda").to(torch.bfloat16)
    h2.w4_packed_linear(x, p, b)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = h2.w4_packed_linear(x, p, b)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y.float(), reference(x, q, zeros, scales, b), atol=TOL[torch.bfloat16],
                               rtol=TOL[torch.bfloat16])


@pytest.mark.parametrize("k, n", [(4096, 6144), (14336, 4096)])
def test_the_sum_after_the_launch_at_real_shapes(k, n):
    # the decode table's w4_gemv_h2_3launch, the baseline bench quant times the in-launch sum against
    from kvrelay.kernels.triton import w4_decode

    check_w4_packed(type("H2", (), {"w4_packed_linear": staticmethod(w4_decode.DECODE_KERNELS["w4_gemv_h2_3launch"])}),
                    "cuda", 1, k, n, 128, torch.bfloat16, "awq", bias=True)


def test_split_sums_back_to_back_and_replayed_each_start_from_a_zeroed_scratch(h2):
    # every split launch reduces in itself (kernels/triton/split_arrival.py): its last split per tile writes the
    # output and zeroes the scratch the next launch adds into. Two weights of one N share that scratch: launches
    # alternating between them with fresh inputs, eager and replayed, each equal their own reference, and the
    # scratch is zero after. A dirty scratch or a last split reading before the others' adds landed fails this.
    from kvrelay.kernels.triton import split_arrival

    cases = [packed_case(4096, 6144, bias=True), packed_case(4096, 6144, group=64)]
    xs = [torch.randn(1, 4096, device="cuda").to(torch.bfloat16) for _ in cases]
    for (p, _, _, _, b), x in zip(cases, xs, strict=True):
        h2.w4_packed_linear(x, p, b)  # compiled and the scratch made outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = [h2.w4_packed_linear(x, p, b) for (p, _, _, _, b), x in zip(cases, xs, strict=True)]
    for step in range(40):
        for x in xs:
            x.copy_(torch.randn_like(x))
        if step % 2:
            graph.replay()
            got = ys
        else:
            got = [h2.w4_packed_linear(x, p, b) for (p, _, _, _, b), x in zip(cases, xs, strict=True)]
        torch.cuda.synchronize()
        for y, (_, q, zeros, scales, b), x, group in zip(got, cases, xs, (128, 64), strict=True):
            torch.testing.assert_close(y.float(), reference(x, q, zeros, scales, b, group),
                                       atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
    assert not any(t.any() for key, pair in split_arrival._scratch.items() if key[1] == 6144 for t in pair)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_a_model_decoding_one_row_at_a_time_generates_the_fp32_gemvs_tokens(tiny_model_dirs, tmp_path, method,
                                                                             monkeypatch):
    """A quantized tiny model (bf16, the activations the kernel is for) with one sequence at a time, so that every
    decode step (in CUDA graphs) is the one row the half2 kernel takes: its greedy tokens under w4_gemv_atomic (fp32
    products) and under w4_gemv_h2 are the same."""
    from kvrelay import LLM, SamplingParams
    from kvrelay.kernels.triton import w4_decode
    from kvrelay.shared.engine.quant.checkpoint import quantize_checkpoint

    ckpt = quantize_checkpoint(tiny_model_dirs["llama"], tmp_path / method, method, group_size=32)
    prompts = [{"prompt_token_ids": [5, 17, 33, 99, 3]}, {"prompt_token_ids": list(range(10, 60))}]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def tokens(kernel: str) -> list[list[int]]:
        monkeypatch.setattr(w4_decode, "DECODE_KERNEL", kernel)
        llm = LLM(model=str(ckpt), device="cuda", dtype="bfloat16", num_gpu_blocks=256, max_num_seqs=1)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    fp32 = tokens("w4_gemv_atomic")
    rows = []
    h2 = w4_decode.DECODE_KERNELS["w4_gemv_h2"]
    monkeypatch.setitem(w4_decode.DECODE_KERNELS, "w4_gemv_h2",
                        lambda x, p, bias=None: rows.append(x.numel() // x.shape[-1]) or h2(x, p, bias))
    assert tokens("w4_gemv_h2") == fp32
    assert 1 in rows
