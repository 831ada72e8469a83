"""The W4 decode GEMV on a GPU (``pytest -m gpu tests/gpu/test_w4_gemv_gpu.py``): kernels/triton/w4_gemv.py
(split K in order and by atomics) at Llama-3-8B projection shapes against dequantize-then-matmul, act-order,
the same bits every call, and a quantized model under each entry of kernels/triton/w4_decode.py's table
generating the CPU reference's tokens.
tests/kernels/test_w4_gemv_interpret.py runs the kernel checks at small shapes on CPU.
"""

import pytest
import torch

from kvrelay.kernels import quant
from tests.kernels.quant_cases import check_w4_packed, w4_case, w4_gemv_variant

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # Llama-3-8B: qkv, o, gate|up, down (K, N)
VARIANTS = ["gemv", "atomic"]


@pytest.mark.parametrize("name, rows", [(name, rows) for name in VARIANTS for rows in (1, 4)])
@pytest.mark.parametrize("k, n", SHAPES)
def test_real_shapes(name, k, n, rows):
    # the default configurations split K at every one of these shapes
    check_w4_packed(w4_gemv_variant(name), "cuda", rows, k, n, 128, torch.bfloat16, "awq")


def test_sixteen_rows():
    # MAX_ROWS: the GEMV's widest build (BLOCK_M 16), the slowest of its builds to compile. It is one compiled
    # kernel at all four projection shapes (every size Triton specialises on is a multiple of 16 there), and the
    # engine sends the GEMV at most w4_decode.DECODE_MAX_ROWS (4) rows, so one shape checks it: down, the
    # longest K. tests/kernels/test_w4_gemv_interpret.py runs 16 rows at small shapes
    check_w4_packed(w4_gemv_variant("gemv"), "cuda", 16, 14336, 4096, 128, torch.bfloat16, "awq")


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_act_order(name, dtype, rows):
    check_w4_packed(w4_gemv_variant(name), "cuda", rows, 4096, 4096, 128, dtype, "gptq_act_order", bias=True)


@pytest.mark.parametrize("cfg", [(1024, 8, 4, 4, 1), (512, 16, 16, 4, 1), (2048, 8, 0, 8, 1), (256, 4, 1, 2, 1)])
def test_tile_shapes_the_sweep_tries(cfg):
    check_w4_packed(w4_gemv_variant("gemv"), "cuda", 1, 14336, 4096, 128, torch.bfloat16, "gptq", bias=True, cfg=cfg)


def test_split_k_in_order_gives_the_same_bits_every_call():
    from kvrelay.kernels.w4_repack import repack_w4

    q, zeros, scales, _, x, _ = w4_case(1, 14336, 4096, 128, torch.bfloat16, False, False)
    packed = repack_w4(quant.pack_w4(q).cuda(), zeros.cuda(), scales.cuda(), 128)
    run = w4_gemv_variant("gemv").w4_packed_linear
    first = run(x.cuda(), packed)
    for _ in range(5):
        assert torch.equal(run(x.cuda(), packed), first)


@pytest.mark.parametrize("kernel", ["w4_fast", "w4_gemv", "w4_gemv_atomic"])
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_models_generate_the_cpu_references_tokens_whichever_decode_kernel(tiny_model_dirs, tmp_path, method, kernel,
                                                                           monkeypatch):
    """tests/gpu/test_quant_gpu.py's check of a quantized tiny model (fp32) on the GPU against the CPU reference,
    under each decode kernel kernels/triton/w4_decode.py can name."""
    from kvrelay import LLM, SamplingParams
    from kvrelay.kernels.triton import w4_decode
    from kvrelay.shared.engine.quant.checkpoint import quantize_checkpoint

    monkeypatch.setattr(w4_decode, "DECODE_KERNEL", kernel)
    ckpt = quantize_checkpoint(tiny_model_dirs["llama"], tmp_path / method, method, group_size=32)
    prompts = [{"prompt_token_ids": [5, 17, 33, 99, 3]}, {"prompt_token_ids": list(range(10, 60))}]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    cpu = LLM(model=str(ckpt), device="cpu", dtype="float32").generate(prompts, params)
    # two prompts: graphs for batches 1, 2 and 4 are all the decode steps take (the default 256 would capture,
    # and compile the quantized kernels for, 23 batch sizes that never run here)
    gpu = LLM(model=str(ckpt), device="cuda", dtype="float32", num_gpu_blocks=256,
              max_num_seqs=4).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in cpu]
