"""The model runner's paged KV cache: how many blocks it gets, its view of a KVPool, the host swap space,
and the swap copies between them. A mixin of ModelRunner (model_runner.py), which sets the attributes
declared below before it calls ``_allocate_kv_cache``.

The KV cache is this model's view of a KVPool (shared/engine/kv_pool.py): a pool shared with co-resident
models when the worker passes one, else a private pool of exactly the size computed here, all of it
owned by this model (so a lone model behaves as if it owned a plain tensor).
"""

import logging
import math

import torch

from kvrelay.shared.config.engine import EngineConfig
from kvrelay.shared.engine.activation_peak import free_kv_blocks
from kvrelay.shared.engine.kv_calibration import calibration_length
from kvrelay.shared.engine.kv_pool import KVPool
from kvrelay.shared.engine.parallel.state import SINGLE
from kvrelay.shared.engine.piecewise_graphs import piecewise_tokens, static_bytes, unsupported
from kvrelay.shared.engine.ranks.group import RankGroup
from kvrelay.shared.engine.scheduler_output import SchedulerOutput
from kvrelay.shared.engine.token_budget import max_batched_tokens
from kvrelay.shared.wire.rank_step import RankAlloc, RankProfile, RankSwap

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30


class RunnerKVCache:
    config: EngineConfig
    device: torch.device
    ranks: RankGroup | None
    model: torch.nn.Module
    kv_dtype: torch.dtype
    block_size: int
    max_model_len: int

    def _allocate_kv_cache(self, kv_pool: KVPool | None, kv_floor_blocks: int | None,
                           kv_pool_key: str | None) -> None:
        """Attach this model to ``kv_pool`` (a private one of the computed size when None) and allocate
        the host swap space; every other rank of a group allocates a cache of the same block count."""
        config = self.config
        max_blocks_per_seq = math.ceil(self.max_model_len / self.block_size)
        if kv_pool is None:
            num_blocks = self._num_kv_blocks()
            if num_blocks < max_blocks_per_seq:
                raise ValueError(
                    f"KV cache too small: {num_blocks} blocks of {self.block_size} tokens hold "
                    f"{num_blocks * self.block_size} tokens, but one sequence of max_model_len={self.max_model_len} "
                    f"needs {max_blocks_per_seq} blocks; raise the KV memory or lower max_model_len"
                )
            kv_pool, kv_floor_blocks = KVPool(num_blocks * self.block_bytes, self.device), num_blocks
        self.kv_pool = kv_pool
        self.kv_pool_key = kv_pool_key or str(config.model.model)
        m = self.model
        # kv_cache: [L, 2, N, bs, Hkv, D] over the whole pool; only kv_block_ids are ours to use now. A group's
        # view stops at the pool's own size: its other ranks each allocate a cache of the view's length
        # (RankAlloc), and a growable pool's view spans the range reserved for growth (its size plus the
        # worker's weights budget), which would be a cache that large, allocated whole, on every other rank.
        # Growing their caches in step with rank 0's chunks would need growable memory on every rank's device
        # and a message per grow; held to the pool's own size, rank 0's block manager is never lent an id
        # past the other ranks' caches (the pool gives no block beyond a view), and those caches are what
        # they were over a fixed pool. The group's KV still grows within that size, taking other models' chunks.
        self.kv_cache, self.kv_block_ids = kv_pool.attach(
            self.kv_pool_key, m.kv_layers, self.block_size, m.num_kv_heads, m.head_dim, self.kv_dtype,
            floor_blocks=kv_floor_blocks or max_blocks_per_seq, within_base=self.ranks is not None)
        self.num_blocks = len(self.kv_block_ids)
        self.num_host_blocks = int(config.cache.swap_space * (1 << 30)) // self.block_bytes
        if self.ranks is not None:  # every rank's cache has rank 0's block count, holding its own heads
            self.ranks.send(RankAlloc(self.kv_cache.shape[2], self.num_host_blocks))
        self.host_cache = None
        if self.num_host_blocks:
            pin = self.device.type == "cuda"
            self.host_cache = torch.zeros(self.kv_shape(self.num_host_blocks), dtype=self.kv_dtype, pin_memory=pin)
        log.info("KV cache: %d blocks x %d tokens (%.1f MiB, %s); swap: %d blocks", self.num_blocks,
                 self.block_size, self.num_blocks * self.block_bytes / 2**20,
                 str(self.kv_dtype).removeprefix("torch."), self.num_host_blocks)

    # -- sizing ---------------------------------------------------------------------------------
    def kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        m = self.model
        return (m.kv_layers, 2, num_blocks, self.block_size, m.num_kv_heads, m.head_dim)

    @property
    def block_bytes(self) -> int:
        m = self.model
        return m.kv_layers * 2 * self.block_size * m.num_kv_heads * m.head_dim * self.kv_dtype.itemsize

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks is not None:
            return cache.num_gpu_blocks
        if cache.kv_cache_memory is not None:
            return cache.kv_cache_memory // self.block_bytes
        if self.device.type != "cuda":
            return CPU_DEFAULT_KV_BYTES // self.block_bytes
        # GPU: what gpu_memory_utilization leaves after the weights and a profiled activation peak
        sched = self.config.scheduler
        num_tokens = max_batched_tokens(sched, self.max_model_len)  # over several prompts where it passes max_model_len
        if cache.calculate_kv_scales:  # its calibration batch is one step even above the budget
            num_tokens = max(num_tokens, calibration_length(self.max_model_len))
        rows = min(num_tokens, sched.max_num_seqs)
        if self.ranks is not None:  # every rank profiles its own device; the group keeps what fits on all
            self.ranks.send(RankProfile(num_tokens, rows, self.max_model_len))
        graph_tokens = self._piecewise_tokens()
        blocks = free_kv_blocks(self.model, num_tokens, rows, self.block_size, self.kv_dtype, self.device,
                                cache.gpu_memory_utilization, self.block_bytes,
                                static_bytes(self.model, graph_tokens) if graph_tokens else None, self.max_model_len,
                                graph_tokens)
        return (self.ranks.state if self.ranks is not None else SINGLE).min_int(blocks)

    def _piecewise_tokens(self) -> int:
        """The largest step the piecewise graphs this runner will capture hold; 0 when it captures none."""
        if self.config.model.graph_mode != "FULL_AND_PIECEWISE" or self.ranks is not None or unsupported(self.model):
            return 0
        return piecewise_tokens(self.config, self.max_model_len)

    # -- swap -----------------------------------------------------------------------------------
    def _swap(self, out: SchedulerOutput) -> None:
        if self.ranks is not None and (out.swap_out or out.swap_in):  # every rank swaps its own heads
            self.ranks.send(RankSwap([list(p) for p in out.swap_out], [list(p) for p in out.swap_in]))
        # swap-outs first: a block freed by a swap-out may be reused by a swap-in of the same step. Blocks
        # move as their bytes (an fp8 cache's stay fp8 under the same fixed scales)
        if not (out.swap_out or out.swap_in):
            return
        dev, host = _raw(self.kv_cache), _raw(self.host_cache)
        if out.swap_out:
            dev_ids, host_ids = zip(*out.swap_out, strict=True)
            host[:, :, list(host_ids)] = dev[:, :, list(dev_ids)].to("cpu")
        if out.swap_in:
            host_ids, dev_ids = zip(*out.swap_in, strict=True)
            dev[:, :, list(dev_ids)] = host[:, :, list(host_ids)].to(self.device)


def _raw(kv: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as uint8 (the same bytes): index copies need not support float8 on every device."""
    return kv.view(torch.uint8) if kv.element_size() == 1 else kv
