"""Models of their own parallel sizes in one worker on CUDA (``pytest -m gpu tests/gpu/test_parallel_placement_gpu.py``,
two GPUs): the KV pool on cuda:0, each group's rank 1 on cuda:1 with a cache of the pool's block count, a group
counting its largest shard against the per-device budget, as tests/unit/test_parallel_placement.py checks over
gloo on CPU (where a group counts every shard)."""

import pytest
import torch

from tests.unit.test_parallel_placement import groups_share_a_worker_as_one_placement_each

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def test_groups_share_a_worker_as_one_placement_each_over_nccl(tiny_model_dirs):
    groups_share_a_worker_as_one_placement_each(str(tiny_model_dirs["llama"]), "cuda:0")
