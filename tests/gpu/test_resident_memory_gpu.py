"""The engine's resident overhead and step peak on CUDA (shared/engine/resident_memory.py): the decode graphs'
private pool and static buffers count beside the tensors the engine holds, and warm-up measures a step peak.

``pytest -m gpu tests/gpu/test_resident_memory_gpu.py`` on a CUDA machine; skips without CUDA.
"""

import pytest
import torch

from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvrelay.shared.engine import EngineCore
from kvrelay.shared.engine.measured_warmup import warm_up_measured
from kvrelay.shared.engine.resident_memory import persistent_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_graphs_and_warm_up_are_measured():
    config = EngineConfig(model=ModelConfig(model="dummy:tiny-llama", load_format="dummy", max_model_len=512),
                          cache=CacheConfig(block_size=16, kv_cache_memory=64 << 20),
                          scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512), device="cuda")
    core = EngineCore(config)
    assert core.runner.graphs is not None
    counted = persistent_bytes(core.runner)
    assert core.resident_overhead_bytes > counted  # the graph pool's segments on top of the static buffers
    before = core.resident_overhead_bytes
    assert warm_up_measured(core) > 0
    assert core.memory.peak_measured and core.step_peak_bytes > 0
    assert core.resident_overhead_bytes >= before
