"""Whole-weight dequantization and the many-rows path of the weight-only matmuls on a GPU
(``pytest -m gpu tests/gpu/test_dequant_gpu.py``): kernels/triton/dequant.py at Llama-3-8B projection shapes
bit for bit against the references, kernels/triton/dequant_linear.py at and around its threshold, inside a
CUDA graph (and after its scratch outgrows what the graph recorded), and the quantized layers of
shared/engine/quant/linear.py reaching it through the kernel registry.
tests/kernels/test_dequant_interpret.py runs the same checks at small shapes on CPU.
"""

import pytest
import torch
import torch.nn.functional as F

from kvrelay.kernels import quant
from tests.kernels.dequant_cases import (
    DEQUANT_FN,
    LAYOUTS,
    check_dequantized,
    check_few_rows,
    check_many_rows,
    count_calls,
    inputs,
    kernel_modules,
    layer,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # Llama-3-8B: qkv, o, gate|up, down (K, N)


@pytest.fixture(scope="module")
def modules():
    pytest.importorskip("triton")
    return kernel_modules()


def _release() -> None:
    # a dozen test processes share the GPU: a gate_up reference holds GBs in fp32
    torch.cuda.empty_cache()


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dequantized_real_shapes(modules, layout, k, n):
    check_dequantized(layer(layout, "cuda", k, n, 128), torch.bfloat16)
    _release()


@pytest.mark.parametrize("layout", ["packed", "plain"])
def test_dequantized_act_order_fp16(modules, layout):
    check_dequantized(layer(layout, "cuda", 4096, 4096, 128, act_order=True), torch.float16)
    _release()


@pytest.mark.parametrize("rows", [256, 2048])
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_many_rows_real_shapes(modules, monkeypatch, layout, k, n, rows):
    dequant, dequant_linear = modules
    monkeypatch.setattr(dequant_linear, "DEQUANT_MIN_ROWS", 256)  # whatever the environment set
    calls = count_calls(monkeypatch, dequant, DEQUANT_FN[layout])
    check_many_rows(layer(layout, "cuda", k, n, 128), rows, k, torch.bfloat16, "cuda")
    assert len(calls) == 1
    _release()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fewer_rows_keep_the_fused_kernel(modules, monkeypatch, layout):
    # 255 rows: w4_fast (split K summed in order) and w4a16's GEMM, both the same bits every call
    dequant, dequant_linear = modules
    monkeypatch.setattr(dequant_linear, "DEQUANT_MIN_ROWS", 256)
    calls = count_calls(monkeypatch, dequant, DEQUANT_FN[layout])
    check_few_rows(layer(layout, "cuda", 4096, 6144, 128), 255, 4096, torch.bfloat16, "cuda")
    assert calls == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_graph_replays_into_the_scratch_it_recorded(modules, monkeypatch, layout):
    # captured after an eager call (as the engine warms every shape up first): the graph records the device's
    # scratch; a larger layer then grows the scratch eagerly, and the graph must still replay correctly
    _, dequant_linear = modules
    monkeypatch.setattr(dequant_linear, "DEQUANT_MIN_ROWS", 256)
    device = torch.device("cuda", torch.cuda.current_device())
    small, big = layer(layout, "cuda", 4096, 4096, 128), layer(layout, "cuda", 4096, 28672, 128)
    x, b = inputs(512, 4096, 4096, torch.bfloat16, "cuda", bias=True)
    dequant_linear._scratch.pop(device, None)
    small.op(x, b)
    torch.cuda.synchronize()
    recorded = dequant_linear._scratch[device]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = small.op(x, b)
    assert dequant_linear._scratch[device] is recorded  # no new buffer inside the capture
    ptr, size = recorded.data_ptr(), recorded.numel()
    del recorded  # only the module's references may keep it now
    big.op(torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16), None)  # grows the scratch eagerly
    assert dequant_linear._scratch[device].data_ptr() != ptr
    assert any(t.data_ptr() == ptr for t in dequant_linear._retired)  # kept alive: the graph writes into it
    torch.cuda.synchronize()
    filler = torch.full((size,), 0x5A, dtype=torch.uint8, device="cuda")  # would take a freed buffer's block
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert bool((filler == 0x5A).all())
    # the graph's result against an eager call's over the new input (cuBLAS may choose another algorithm inside
    # a capture: close, not equal; a graph reading a stale or foreign buffer is off by the outputs' size)
    torch.testing.assert_close(y.float(), small.op(x, b).float(), atol=2e-2, rtol=2e-2)
    _release()


@pytest.mark.parametrize("method", ["awq", "int8"])
def test_quantized_layers_reach_the_dequantized_path(modules, monkeypatch, method):
    # through kernels.w4_packed_linear / kernels.int8_linear, as a model's forward calls them
    from kvrelay.shared.engine.quant.config import QuantConfig
    from kvrelay.shared.engine.quant.linear import make_linear

    dequant, dequant_linear = modules
    monkeypatch.setattr(dequant_linear, "DEQUANT_MIN_ROWS", 256)
    calls = count_calls(monkeypatch, dequant, "dequantize_w4_packed" if method == "awq" else "dequantize_channel")
    quant_config = QuantConfig(method, prequantized=False, group_size=128)
    with torch.device("cuda"):
        lin = make_linear(4096, 6144, False, torch.bfloat16, quant_config, torch.nn.Linear)
    lin.init_dummy(0, "model.layers.0.self_attn.qkv_proj")
    x = torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        y = lin(x)
    assert len(calls) == 1
    w = lin.dequantize() if method == "awq" else quant.dequantize_channel(lin.weight, lin.weight_scale)
    expected = F.linear(x.float(), w.float())
    torch.testing.assert_close(y.float(), expected, atol=3e-2, rtol=3e-2)
    with torch.inference_mode():
        lin(x[:255])
    assert len(calls) == 1
