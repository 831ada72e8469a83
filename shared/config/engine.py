"""Engine configuration as dataclasses; field names follow vLLM's CLI flags (``--max-num-seqs`` is
``max_num_seqs``)."""

from dataclasses import dataclass, field

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ModelConfig:
    model: str  # HF-style directory, or "dummy:<preset>" together with load_format="dummy"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    max_model_len: int | None = None  # None: the model's own max_position_embeddings
    load_format: str = "auto"  # auto | dummy
    tokenizer: str | None = None  # defaults to the model directory
    seed: int = 0
    served_model_name: str | None = None
    enforce_eager: bool = False  # on CUDA: no decode CUDA graphs (debugging, comparison benchmarks)

    def torch_dtype(self, device: str) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if device == "cpu" else torch.bfloat16
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        return DTYPES[self.dtype]


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9  # on CUDA: fraction of device memory for weights + KV
    kv_cache_memory: int | None = None  # bytes; on CPU the default is 1 GiB
    num_gpu_blocks: int | None = None  # overrides both of the above ("gpu" = the device cache, as in vLLM)
    swap_space: float = 0.0  # GiB of host memory for preempted requests' KV; 0 = preempt by recompute
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be non-negative, got {self.swap_space}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 2048 with chunked prefill, else max_model_len
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # fcfs | priority (lower value first, then arrival)
    # Share admission between tenants by tokens served (shared/engine/fair_queue.py). On by default: with one
    # tenant it orders exactly like the plain policy, so only multi-tenant traffic sees a difference.
    tenant_fairness: bool = True
    tenant_kv_quota: float | None = None  # max share of KV blocks one tenant may hold before it must wait

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be fcfs or priority, got {self.policy!r}")
        if self.tenant_kv_quota is not None and not 0 < self.tenant_kv_quota <= 1:
            raise ValueError(f"tenant_kv_quota must be in (0, 1], got {self.tenant_kv_quota}")


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "auto"  # auto | cpu | cuda[:N]

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
