"""What one engine core holds in memory, as a worker's budget counts it (weights, KV pool, what the model keeps
beside them, its step peak), and the unload that gives it all back. EngineCore inherits this: callers read
``core.weight_bytes`` and call ``core.release_kv()`` on the core, never on this class."""

from kvrelay.shared.engine.async_step import AsyncStepper
from kvrelay.shared.engine.block_manager import BlockManager
from kvrelay.shared.engine.model_runner import ModelRunner
from kvrelay.shared.engine.resident_memory import ResidentMeter
from kvrelay.shared.engine.scheduler import Scheduler
from kvrelay.shared.engine.structured.manager import StructuredOutputManager


class CoreMemory:
    # set by EngineCore.__init__
    runner: ModelRunner
    memory: ResidentMeter
    block_manager: BlockManager
    scheduler: Scheduler
    structured: StructuredOutputManager
    stepper: AsyncStepper | None

    @property
    def block_bytes(self) -> int:
        """KV bytes of one block, all layers."""
        return self.runner.block_bytes

    @property
    def kv_pool_bytes(self) -> int:
        """The KV pool this engine draws its blocks from, whole: co-resident models share it."""
        return self.runner.kv_pool.nbytes

    @property
    def weight_bytes(self) -> int:
        """This process's weights: rank 0's shard (stage) alone when the model is tensor- or pipeline-parallel."""
        return sum(p.numel() * p.element_size() for p in self.runner.model.parameters())

    @property
    def resident_overhead_bytes(self) -> int:
        """Memory this model keeps while loaded besides its weights and KV (shared/engine/resident_memory.py)."""
        return self.memory.overhead_bytes

    @property
    def step_peak_bytes(self) -> int:
        """Its largest step's temporaries above what is resident, as warm-up measured them (CUDA; else 0)."""
        return self.memory.step_peak_bytes

    @property
    def model_bytes(self) -> int:
        """This process's bytes of the model's own tensors besides its KV: weights and buffers (rotary tables),
        each storage once (tied embeddings share one)."""
        model = self.runner.model
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (*model.parameters(), *model.buffers())}
        return sum(storages.values())

    def release_kv(self) -> None:
        """Unload: give this model's KV memory back to its pool, then let go of its weights, decode graphs
        and buffers. Refused while requests are unfinished or hold blocks; the core must not be stepped
        afterwards. The memory is free once this returns (and the caching allocator is emptied) even while
        something still holds the core: with async scheduling the core is in a reference cycle (its stepper
        calls back into it), so a reference left in some frame when the unloader collects garbage would
        otherwise keep every weight alive until the collector next reaches that generation."""
        bm = self.block_manager
        if self.scheduler.has_unfinished() or bm.num_used or not bm.release_free_blocks(list(bm.owned)):
            raise RuntimeError(f"{self.runner.kv_pool_key}: requests still hold KV blocks; "
                               "abort or finish them before releasing the KV cache")
        self.runner.kv_pool.detach(self.runner.kv_pool_key)
        self.structured.close()  # its compile thread and compiled grammars go with the model
        self.stepper = None  # its launched step's device tensors
        self.runner.release()  # its tensor-parallel ranks, weights, graphs and buffers
