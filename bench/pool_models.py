"""The N models of ``kvrelay bench pool`` (bench/pool_density.py): model i is ``--model`` with dummy weights of
seed ``seed + i``, loaded as a worker loads one (shared/worker/model_loads.py) and freed checked
(bench/pool_memory.py)."""

import argparse
import time

import torch

from kvrelay.bench import pool_memory
from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvrelay.shared.engine import EngineCore, KVPool
from kvrelay.shared.engine.loader import load_model
from kvrelay.shared.engine.warmup import build_engine, warm_up
from kvrelay.shared.repo.model_source import resolve_model
from kvrelay.shared.worker.step_lock import HoldTimes, LockedPool

# what a load does, in order; the step lock is taken in the last two (in engine build, for the pool attach and
# each CUDA graph's capture: the holds of the graphs are labelled on their own)
PHASES = ("weights", "engine build", "warm-up")


class Models:
    """Builds and frees the N models' engines."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.path = resolve_model(args.model, args.load_format).path
        self.memory = pool_memory.DeviceMemory(torch.device(self.config(0, None).device))
        # frees an engine and checks it is gone (bench/pool_memory.py): the caller passes its last reference,
        # so no wrapper frame of ours may stand between
        self.free = self.memory.free
        self.loads: list[float] = []  # seconds of every load, warm-up included

    def config(self, i: int, kv_bytes: int | None) -> EngineConfig:
        a = self.args
        return EngineConfig(
            model=ModelConfig(self.path, dtype=a.dtype, max_model_len=a.max_model_len, load_format="dummy",
                              seed=a.seed + i),
            cache=CacheConfig(block_size=a.block_size, kv_cache_memory=kv_bytes),
            scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens),
            device=a.device, async_scheduling=a.async_scheduling)

    def load(self, i: int, kv_bytes: int | None = None, pool: KVPool | None = None, holds: HoldTimes | None = None,
             phases: dict[str, float] | None = None, on_phase=None) -> EngineCore:
        """Weights first, holding nothing; then the engine (its KV attached to ``pool``, its CUDA graphs captured)
        and its warm-up, taking the step lock through ``holds`` in pieces as a worker's load does: the pool
        attach, each graph, each warm-up shape, every hold timed. ``phases``: each phase's wall seconds; ``on_phase``:
        called with each phase's name (PHASES) as it starts."""
        enter = on_phase or (lambda phase: None)
        enter(PHASES[0])
        t0 = time.perf_counter()
        config = self.config(i, kv_bytes)
        loaded = load_model(config.model, config.device, progress=False)
        self.memory.load_transient = self.memory.transient()
        t_weights = time.perf_counter()
        device = torch.device(config.device)
        cuda = device.type == "cuda"

        def hold(phase: str):
            return holds.hold(phase) if holds is not None else None

        enter(PHASES[1])
        kv_pool = LockedPool(pool, hold("engine build")) if pool is not None and holds is not None else pool
        core = build_engine(lambda: EngineCore(config, kv_pool=kv_pool, kv_pool_key=f"model-{i}" if pool else None,
                                               loaded=loaded), hold("graph capture"))
        t_engine = time.perf_counter()
        enter(PHASES[2])
        warm_up(core, compiles=cuda, hold=hold("warm-up"))
        if cuda:  # this thread's work done; a device-wide sync would wait for the other models' steps too
            torch.cuda.current_stream(device).synchronize()
        end = time.perf_counter()
        if holds is not None:
            holds.done()
        if phases is not None:
            phases.update(zip(PHASES, (t_weights - t0, t_engine - t_weights, end - t_engine), strict=True))
        self.loads.append(end - t0)
        return core
