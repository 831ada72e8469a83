"""How much memory the models a worker hosts share: one KV pool for all of them and a budget for their
weights together (shared/worker/model_host.py admits loads against both)."""

import torch

from kvrelay.shared.config.worker import WorkerConfig
from kvrelay.shared.engine.kv_pool import KVPool

CPU_DEFAULT_KV_BYTES = 1 << 30
CPU_DEFAULT_WEIGHTS_BYTES = 8 << 30
# CUDA: the caching allocator's fragmentation across loads and evictions, which no model's measurement sees.
# Each model's graphs and buffers and the one step peak are counted against the budget by the model host
# (shared/worker/load_room.py), measured per model, no longer a flat reserve taken from it.
ALLOCATOR_SLACK = 1 << 30


def host_budget(config: WorkerConfig) -> tuple[KVPool | None, int]:
    """(the KV pool several models share, the bytes their weights, what each keeps beside them (graphs,
    buffers) and one step's peak may take together).

    One model and no repository: no shared pool (the engine sizes its own KV exactly as a single-model
    server does) and no budget to enforce. Otherwise the pool is ``--kv-cache-memory`` bytes (CPU
    default 1 GiB); the models get ``--weights-memory`` (CPU default 8 GiB; CUDA default: what
    ``--gpu-memory-utilization`` leaves after the pool, less ALLOCATOR_SLACK).

    The pool may grow into the part of the weights budget no model's weights use (the model host moves
    its cap, shared/engine/kv_pool.py), so it reserves both together. Except a decode worker's on a GPU:
    prefill workers on its device write into that cache through a CUDA IPC handle (cudaIpcGetMemHandle,
    shared/handoff/cuda_ipc.py), which memory mapped through the driver's virtual memory management
    cannot give; that pool stays its fixed size, and says so once."""
    if not config.multi_model:
        return None, 0
    engine = config.engine
    device = torch.device(engine.device)
    if device.type == "cuda":
        usable = int(torch.cuda.get_device_properties(device).total_memory * engine.cache.gpu_memory_utilization)
        kv = engine.cache.kv_cache_memory or usable // 2
        weights = config.weights_memory or max(0, usable - kv - ALLOCATOR_SLACK)
    else:
        kv = engine.cache.kv_cache_memory or CPU_DEFAULT_KV_BYTES
        weights = config.weights_memory or CPU_DEFAULT_WEIGHTS_BYTES
    ipc = device.type == "cuda" and config.role == "decode"
    return KVPool(kv, device, max_bytes=kv + weights, fixed_because="prefill workers write into it through "
                  "CUDA IPC, which cannot share driver-mapped (growable) memory" if ipc else ""), weights
