"""The prefill e4m3 GEMM on a GPU (``pytest -m gpu tests/gpu/test_fp8_gemm_gpu.py``): every named config of
kernels/triton/fp8_gemm.py at the Llama-3-8B projection shapes against the e4m3 operands multiplied in fp32 and
scaled after, with cuBLASLt's row-wise ``torch._scaled_mm`` error beside it for scale; and fp8_linear routing
prefill rows through it when asked. tests/kernels/test_fp8_gemm_interpret.py runs the configs at small tiles on CPU.
"""

import importlib

import pytest
import torch

from kvrelay.kernels.triton import fp8_gemm as fg
from kvrelay.kernels.triton.fp8_quant import quantize_per_token_fp8

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0),
                                 reason="TMA descriptors need Hopper")]
SHAPES = [(28672, 4096), (4096, 14336), (6144, 4096), (4096, 4096)]  # gate|up, down, qkv, o
ROWS = 1000  # no tile divides it


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def case(request):
    n, k = request.param
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(ROWS, k, generator=g, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, generator=g, device="cuda") * k**-0.5
    sw = w.abs().amax(1) / 448.0
    wq = (w / sw[:, None]).to(torch.float8_e4m3fn)
    xq, sx = quantize_per_token_fp8(x)
    exact = (xq.float() @ wq.float().t()) * sx.float() * sw[None, :]
    cublas = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.view(1, -1), out_dtype=torch.bfloat16)
    # one rounding to bf16 is at most half an ulp of the largest output; cuBLASLt's own error beside it, for scale
    bound = max((cublas.float() - exact).abs().max().item(), exact.abs().max().item() * 2.0**-8) * 1.01
    return x, xq, sx, wq, sw, exact, bound


@pytest.mark.parametrize("name", sorted(fg.CONFIGS))
def test_every_config_at_the_real_shapes(case, name):
    _, xq, sx, wq, sw, exact, bound = case
    got = fg.fp8_gemm(xq, sx, wq, sw, config=name)
    err = (got.float() - exact).abs().max().item()
    assert err <= bound, (err, bound)


def test_fp8_linear_routes_prefill_rows_through_it(case, monkeypatch):
    x, xq, sx, wq, sw, exact, bound = case
    fp8_linear = importlib.import_module("kvrelay.kernels.triton.fp8_linear")  # the package's name is the function
    calls, gemm = [], fg.fp8_gemm
    monkeypatch.setattr(fp8_linear, "PREFILL_GEMM", "triton")
    monkeypatch.setattr(fg, "fp8_gemm", lambda *a, **kw: calls.append(1) or gemm(*a, **kw))
    y = fp8_linear.fp8_linear(x, wq, sw)
    assert calls and (y.float() - exact).abs().max().item() <= bound
