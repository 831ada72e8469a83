"""The 16-256 row GEMM on a GPU (``pytest -m gpu tests/gpu/test_mid_linear_gpu.py``): every named config of
kernels/triton/mid_linear.py at the Llama-3-8B projection shapes and 128 rows (the batch-128 decode step of
issue #22) against the fp32 product, with cuBLAS's error beside it for scale.
tests/kernels/test_mid_linear_interpret.py runs the configs at small shapes on CPU.
"""

import pytest
import torch
import torch.nn.functional as F

from kvrelay.kernels.triton import mid_linear as ml

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SHAPES = [(28672, 4096), (4096, 14336), (6144, 4096), (4096, 4096), (128256, 4096)]  # gate|up, down, qkv, o, lm_head


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def case(request):
    n, k = request.param
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(128, k, generator=g, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16) * k**-0.5
    b = torch.randn(n, generator=g, device="cuda", dtype=torch.bfloat16)
    return x, w, b, F.linear(x.float(), w.float(), b.float())


@pytest.mark.parametrize("name", sorted(ml.CONFIGS))
def test_every_config_at_the_real_shapes(case, name):
    x, w, b, expected = case
    got = ml.mid_linear(x, w, b, config=name)
    # fp32 sums in any order, cast once: within one bf16 rounding of the fp32 product (half an ulp, 2^-8
    # relative), with room for the order of fp32 additions to tip a rounding (one ulp)
    torch.testing.assert_close(got.float(), expected, rtol=2.0**-7, atol=1e-3)
    cublas = (F.linear(x, w, b).float() - expected).abs().max()
    assert (got.float() - expected).abs().max() <= 2 * cublas + 1e-3


@pytest.mark.parametrize("name", sorted(n for n, c in ml.CONFIGS.items() if c.variant == "split"))
def test_split_k_gives_the_same_bits_every_run(case, name):
    # the split partials are added in a fixed order (atomics and stream-K promise no such thing)
    x, w, b, _ = case
    assert torch.equal(ml.mid_linear(x, w, b, config=name), ml.mid_linear(x, w, b, config=name))
