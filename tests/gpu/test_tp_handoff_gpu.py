"""The KV handoff across tensor-parallel layouts on CUDA (``pytest -m gpu tests/gpu/test_tp_handoff_gpu.py``,
two GPUs): the ranks' heads gathered to rank 0 and scattered from it over NCCL, as
tests/unit/test_tensor_parallel_handoff.py checks over gloo on CPU."""

import pytest
import torch

from tests.unit.test_tensor_parallel_handoff import handoffs_across_layouts_continue_like_one_rank

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def test_kv_regrouped_between_tp2_and_tp1_over_nccl(tiny_model_dirs):
    handoffs_across_layouts_continue_like_one_rank(tiny_model_dirs["llama"], "cuda:0")
