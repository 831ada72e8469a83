"""One model's resident overhead and step peak on CUDA as the engine measures them (shared/engine/resident_memory.py),
against the device's own count (torch.cuda.mem_get_info with the allocator emptied, KV and weights taken out) and
against the estimate a worker plans with before any model of the shape is loaded (shared/worker/model_overhead.py).

    python -m kvrelay.bench.resident_probe --model dummy:llama-3-8b --max-num-seqs 256
"""

import argparse
import gc
import time

import torch

from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvrelay.shared.engine import EngineCore
from kvrelay.shared.engine.measured_warmup import warm_up_measured
from kvrelay.shared.worker.model_overhead import estimate_costs

GIB = 2**30


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="dummy:llama-3-8b")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--kv-cache-memory", type=int, default=4 << 30)
    args = p.parse_args()
    config = EngineConfig(model=ModelConfig(model=args.model, load_format="dummy", max_model_len=args.max_model_len),
                          cache=CacheConfig(kv_cache_memory=args.kv_cache_memory),
                          scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                                    max_num_batched_tokens=args.max_num_batched_tokens),
                          device="cuda")
    est_overhead, est_peak = estimate_costs(config, None)

    def used() -> int:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        return total - free

    torch.zeros(1, device="cuda")  # the context first: it is no model's
    base = used()
    t0 = time.perf_counter()
    core = EngineCore(config)
    built = core.resident_overhead_bytes
    t1 = time.perf_counter()
    warm_up_measured(core)
    t2 = time.perf_counter()
    kv = core.kv_pool_bytes
    device = used() - base - kv - core.weight_bytes
    print(f"{args.model} max_num_seqs={args.max_num_seqs} tokens={core.max_num_batched_tokens} "
          f"max_len={core.max_model_len}: weights {core.weight_bytes / GIB:.3f} GiB, KV {kv / GIB:.3f} GiB")
    print(f"  overhead measured {core.resident_overhead_bytes / GIB:.3f} GiB (after build {built / GIB:.3f}, "
          f"build {t1 - t0:.1f} s, warm-up {t2 - t1:.1f} s); device count {device / GIB:.3f} GiB; "
          f"estimate {est_overhead / GIB:.3f} GiB")
    print(f"  step peak measured {core.step_peak_bytes / GIB:.3f} GiB; estimate {est_peak / GIB:.3f} GiB; "
          f"max allocated since start {torch.cuda.max_memory_allocated() / GIB:.3f} GiB")


if __name__ == "__main__":
    main()
