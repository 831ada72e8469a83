"""Dummy weights on CUDA are the CPU's, bit for bit (``pytest -m gpu tests/gpu/test_dummy_weights_gpu.py``; skips
without CUDA): they are an integer hash of each element's index (shared/engine/dummy_weights.py), so neither
the device nor its SM count (which CUDA MPS shrinks, and torch's random kernels size their grid from) moves
them. A prefill and a decode process on different shares of a GPU, or on different devices, hold one model."""

import pytest
import torch

from kvrelay.shared.config.engine import ModelConfig
from kvrelay.shared.engine import dummy_weights
from kvrelay.shared.engine.dummy_weights import fill_bits_, fill_normal_
from kvrelay.shared.engine.loader import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


# unquantized: int8/fp8 scales come from kernels/quant.py's ``amax / top``, which CUDA computes as a multiply by
# the reciprocal, a last-place difference from the CPU's that is no part of the dummy values
@pytest.mark.parametrize(("preset", "dtype"), [("tiny-llama", "float32"), ("tiny-llama", "bfloat16")])
def test_a_dummy_model_on_cuda_is_the_cpu_model(preset, dtype):
    def load(device):
        config = ModelConfig(f"dummy:{preset}", load_format="dummy", dtype=dtype, seed=3)
        return dict(load_model(config, device, progress=False)[0].named_parameters())
    cpu, cuda = load("cpu"), load("cuda")
    assert cpu.keys() == cuda.keys()
    for name, p in cuda.items():
        assert p.dtype == cpu[name].dtype and torch.equal(p.cpu().view(torch.uint8), cpu[name].view(torch.uint8)), name


def test_chunked_fills_on_cuda_are_the_cpus():
    # three whole chunks and a ragged 7-element one on one side, one chunk on the other (n is below CPU_CHUNK
    # and DEVICE_CHUNK): the point is the chunk boundaries, not the size, which only made the CPU's hashing slow
    chunk = 1 << 14
    n = 3 * chunk + 7
    assert n < min(dummy_weights.CPU_CHUNK, dummy_weights.DEVICE_CHUNK)
    on_cuda = fill_normal_(torch.empty(n, device="cuda"), 0, "w", 0.02, chunk=chunk).cpu()
    assert torch.equal(on_cuda, fill_normal_(torch.empty(n), 0, "w", 0.02))
    bits = fill_bits_(torch.empty(n, dtype=torch.int32, device="cuda"), 0, "q").cpu()
    assert torch.equal(bits, fill_bits_(torch.empty(n, dtype=torch.int32), 0, "q", chunk=chunk))
