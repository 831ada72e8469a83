"""Shared weights over CUDA IPC (``pytest -m gpu tests/gpu/test_shared_weights_gpu.py``; skips without CUDA):
another process loads a model and exports its arena; this one maps it through the registry
(shared/worker/shared_weights.py), gets bit-identical weights, no second copy of device memory, and the
same greedy tokens, CUDA graphs included, as a private load; when the exporter is killed with -9, ``lost()``
names the model (the worker then exits for a restart: IPC memory dies with the process that allocated it)."""

import gc
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig
from kvrelay.shared.engine.engine_core import EngineCore
from kvrelay.shared.engine.loader import load_model
from kvrelay.shared.wire.sampling_params import SamplingParams
from kvrelay.shared.worker.shared_weights import SharedWeights
from kvrelay.shared.worker.weight_registry import WeightRegistry

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PRESET = "smollm2-135m"  # large enough that a second copy shows in the device's memory, small enough to load fast


def engine_config() -> EngineConfig:
    return EngineConfig(ModelConfig(f"dummy:{PRESET}", load_format="dummy", dtype="bfloat16", max_model_len=512,
                                    seed=11), cache=CacheConfig(num_gpu_blocks=256), device="cuda")


_EXPORTER = textwrap.dedent(f"""
    import sys, time
    from pathlib import Path
    from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig
    from kvrelay.shared.engine.loader import load_model
    from kvrelay.shared.worker.shared_weights import SharedWeights
    engine = EngineConfig(ModelConfig("dummy:{PRESET}", load_format="dummy", dtype="bfloat16", max_model_len=512,
                                      seed=11), cache=CacheConfig(num_gpu_blocks=256), device="cuda")
    shared = SharedWeights("cuda", Path(sys.argv[1]))
    arena = shared.arena(shared.key(engine), "m")
    model, _ = load_model(engine.model, "cuda", progress=False, arena=arena)
    shared.loaded(arena)
    print(arena.how, flush=True)
    time.sleep(600)
""")


def greedy(core: EngineCore) -> list[list[int]]:
    prompts = [[5, 17, 99, 203, 7], list(range(40, 140)), [1] * 33]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(core.make_request(f"r{i}", p, params))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished():
        for o in core.step():
            out[o.request_id] += o.new_token_ids
    return [out[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture()
def exporter(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _EXPORTER, str(tmp_path / "shared")], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "exported"
    yield proc
    proc.kill()
    proc.wait()


def test_a_model_mapped_over_cuda_ipc_serves_the_same_tokens_and_is_lost_with_its_exporter(tmp_path, exporter):
    config = engine_config()
    shared = SharedWeights("cuda", tmp_path / "shared")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    arena = shared.arena(shared.key(config), "m")
    loaded = load_model(config.model, "cuda", progress=False, arena=arena)
    shared.loaded(arena)
    assert arena.how == "mapped" and arena.filled
    # the mapped weights are the exporter's allocation: this process's allocator holds none of them
    assert torch.cuda.memory_allocated() - before < shared.device_bytes() // 10

    private = load_model(config.model, "cuda", progress=False)
    pm, sm = dict(private[0].named_parameters()), dict(loaded[0].named_parameters())
    assert pm.keys() == sm.keys() and all(torch.equal(pm[n], sm[n]) for n in pm)
    mapped_tokens = greedy(EngineCore(config, loaded=loaded))  # CUDA graphs captured over mapped weights
    assert mapped_tokens == greedy(EngineCore(config, loaded=private))

    assert shared.lost() == []
    del loaded, sm  # nothing of ours touches the memory once its owner is gone
    gc.collect()
    torch.cuda.synchronize()
    exporter.send_signal(signal.SIGKILL)
    exporter.wait(10)
    deadline = time.monotonic() + 30
    while shared.lost() != ["m"]:
        assert time.monotonic() < deadline, "the dead exporter's model never reported lost"
        time.sleep(0.2)
    assert WeightRegistry(tmp_path / "shared").snapshot() == {}  # a CUDA entry goes with its exporter
