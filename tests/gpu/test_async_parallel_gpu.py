"""Async scheduling on a tensor-parallel pair of CUDA devices (``pytest -m gpu``, two GPUs): rank 0 broadcasts
the ids it sampled a step ago from its device over NCCL, queued behind the sampling, and the tokens, finish
and stop reasons equal the synchronous one-process engine's on the same device in fp32, as
tests/unit/test_async_parallel.py checks over gloo on CPU."""

import pytest
import torch

from tests.unit.test_async_parallel import generate

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)], ids=["tp2", "pp2"])
def test_async_pair_over_nccl_equals_synchronous_one_process(tiny_model_dirs, layout):
    expected, _ = generate(tiny_model_dirs["llama"], device="cuda:0")
    got, num_fed = generate(tiny_model_dirs["llama"], device="cuda:0", async_scheduling=True, **layout)
    assert got == expected
    assert num_fed > 0
