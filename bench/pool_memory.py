"""What ``kvrelay bench pool`` (bench/pool_density.py) measures about memory, and how many models it plans
to fit from that.

Before either mode runs, model 0 is loaded once, as every later load is (weights, engine, CUDA graphs,
warm-up), with a private KV cache of ``--min-kv-seqs`` sequences so warm-up runs the step shapes traffic
makes, then freed: the probe. On CUDA it measures the device memory the loaded model keeps in use, its KV
aside (torch.cuda.mem_get_info with the caching allocator emptied: weights, graph pools and executables,
buffers, allocator rounding; more than the parameters a shape-based estimate counts), and the temporaries
above that: the warm-up's peak (a step's activations; steps run one at a time, so it is held back once)
plus the weights' build's (a cold load builds its weights beside another model's step). The budget is ``--gpu-memory-utilization`` of the device less what is in use once the probe is gone
(the CUDA context, other processes, the one-time state of a first load), or ``--memory``. HEADROOM more is
held back for the caching allocator's fragmentation over evictions and loads. On the CPU no allocator
reports memory: a model costs the bytes of its engine's tensors, counted, and nothing is held back.

Every free (an eviction, the end of a mode) checks that the engine is gone, not merely released (the
weights of one still referenced would stay in use while the next model loads into the memory counted
free), and on CUDA records memory_allocated before and after it.
"""

import argparse
import gc
import time
import weakref
from dataclasses import dataclass

import torch

from kvrelay.bench.pool_report import size
from kvrelay.shared.engine import EngineCore

HEADROOM = 1 << 30  # CUDA: the caching allocator's fragmentation across evictions and loads


def add_memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory", type=int, default=0,
                   help="bytes the models may take in all: weights, graphs and buffers, KV, a step's activations "
                        "(0: CUDA --gpu-memory-utilization of the device less what is in use; CPU room for all "
                        "models but one)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA: fraction of the device's memory the budget reaches (default 0.9)")


def check_memory_args(args: argparse.Namespace, device: torch.device) -> None:
    """The memory flags' mistakes, one line naming the flag, before anything loads."""
    util = args.gpu_memory_utilization
    if util is not None and device.type != "cuda":
        raise SystemExit("--gpu-memory-utilization: only on a CUDA device (the device here is the CPU)")
    if util is not None and args.memory:
        raise SystemExit("--gpu-memory-utilization: not with --memory, which sets the budget in bytes")
    if util is not None and not 0 < util <= 1:
        raise SystemExit(f"--gpu-memory-utilization: must be in (0, 1], got {util}")
    args.gpu_memory_utilization = 0.9 if util is None else util


class DeviceMemory:
    """The device's memory as the bench reads it; ``measured`` is False on the CPU, where nothing is read."""

    def __init__(self, device: torch.device):
        self.device = device
        self.measured = device.type == "cuda"
        self.frees: list[tuple[int, int]] = []  # CUDA: memory_allocated before and after each engine freed
        self.load_transient = 0  # CUDA: the latest load's temporaries while its weights were built

    def settle(self) -> None:
        """Collect garbage and hand the caching allocator's free blocks back, so what is read is what is held."""
        gc.collect()
        if self.measured:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def used(self) -> int:
        """Bytes in use on the device, by anyone (0 on the CPU)."""
        if not self.measured:
            return 0
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def total(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory if self.measured else 0

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.measured else 0

    def transient(self) -> int:
        """CUDA: bytes allocated at the peak since the last call above what is allocated now, the temporaries
        of what ran meanwhile; the count restarts. 0 on the CPU."""
        if not self.measured:
            return 0
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return max(0, peak - torch.cuda.memory_allocated(self.device))

    def free(self, core: EngineCore, checked: bool = True) -> None:
        """Release the engine (the caller holds no other reference) and check it is gone. ``checked=False``
        after an error: its traceback's frames may still hold the engine, and that error is the one to report."""
        gone = weakref.ref(core)
        before = self.allocated()
        core.release_kv()
        del core
        self.settle()
        if checked and gone() is not None:
            holders = ", ".join(type(r).__name__ for r in gc.get_referrers(gone())) or "a running frame's variable"
            raise RuntimeError(f"a freed engine is still referenced (by {holders}): the bench would load the next "
                               "model into memory it counts free")
        if self.measured:
            self.frees.append((before, self.allocated()))


@dataclass
class Probe:
    model_bytes: int  # one resident model, its KV aside
    peak_bytes: int  # temporaries above the resident models: a step's and a weight build's (CUDA; 0 on the CPU)
    weight_bytes: int
    load_s: float
    leftover: int  # device memory the probe's free did not give back: one-time state of a first load


def probe(load, memory: DeviceMemory, kv_bytes: int) -> Probe:
    """Load model 0 with ``kv_bytes`` of private KV through ``load(kv_bytes)``, measure it, free it."""
    memory.settle()
    before = memory.used()
    memory.transient()  # counted from here
    t0 = time.perf_counter()
    held = [load(kv_bytes)]  # popped into free: no local may keep the engine past it
    load_s = time.perf_counter() - t0
    # the engine's build, graph capture and warm-up steps, and before them the weights' build: in the pool's
    # run a cold load's weights are built beside another model's step, so both count
    peak_bytes = memory.transient() + memory.load_transient
    kv = held[0].num_total_blocks * held[0].block_bytes
    weights = held[0].weight_bytes
    if memory.measured:
        memory.settle()
        model_bytes = max(weights, memory.used() - before - kv)  # never below its parameters, whatever else ran
    else:
        model_bytes = held[0].model_bytes
    memory.free(held.pop())
    return Probe(model_bytes=model_bytes, peak_bytes=peak_bytes, weight_bytes=weights, load_s=load_s,
                 leftover=max(0, memory.used() - before))


def budget(args: argparse.Namespace, memory: DeviceMemory, p: Probe, seq_kv: int) -> tuple[int, int, str]:
    """(bytes the models may take in all, headroom held back from it, how the budget was set)."""
    headroom = HEADROOM if memory.measured else 0
    if args.memory:
        return args.memory, headroom, "--memory"
    if memory.measured:
        total, used = memory.total(), memory.used()
        return (int(total * args.gpu_memory_utilization) - used, headroom,
                f"{args.gpu_memory_utilization:.0%} of {size(total)} less {size(used)} in use")
    n = args.num_models
    return (n - 1) * (p.model_bytes + seq_kv) + args.min_kv_seqs * seq_kv, 0, "CPU: room for all models but one"


def plan(args: argparse.Namespace, p: Probe, seq_kv: int, memory: int, headroom: int) -> dict:
    """How the budget is used each way: resident models and pool bytes; static models and KV each. A resident
    model costs what the probe measured, plus its KV floor (one max-length sequence) in the pool; the pool
    also holds the serving room (``--min-kv-seqs`` sequences) one busy model grows into."""
    n, need_kv, per = args.num_models, args.min_kv_seqs * seq_kv, p.model_bytes
    room = memory - p.peak_bytes - headroom  # for the models and their KV
    resident = max((r for r in range(n + 1) if room - r * per >= r * seq_kv + need_kv - seq_kv), default=0)
    static = max((k for k in range(1, n + 1) if room // k >= per + need_kv), default=0)
    return {"memory": memory, "room": room, "model_bytes": per, "peak_bytes": p.peak_bytes, "headroom": headroom,
            "resident": resident, "pool_bytes": room - resident * per,
            "static_models": static, "static_kv": (room // static - per) if static else 0}


def describe(p: Probe, plan_: dict, how: str) -> str:
    """The budget line the bench prints before the plan."""
    extra = f"; {size(p.leftover)} of the probe not freed (one-time state of a first load)" if p.leftover else ""
    return (f"memory: budget {size(plan_['memory'])} ({how}); a model takes {size(p.model_bytes)} besides its KV "
            f"({size(p.weight_bytes)} of weights), temporaries {size(p.peak_bytes)}, headroom "
            f"{size(plan_['headroom'])}: measured on model 0 (probe load {p.load_s:.2f} s{extra})")


def frees_line(memory: DeviceMemory, since: int, evictions: int) -> str:
    """What the frees from index ``since`` on gave back, for the pool's report."""
    frees = memory.frees[since:]
    if not frees:
        return f"  {evictions} eviction(s); every evicted engine was gone before the next load"
    freed = sorted(b - a for b, a in frees)
    before, after = frees[0]
    return (f"  {evictions} eviction(s); every evicted engine was gone before the next load; {len(frees)} engine(s) "
            f"freed in all (evictions, the run's end), device memory allocated "
            f"{size(before)} -> {size(after)} at the first, freed min {size(freed[0])} / median "
            f"{size(freed[len(freed) // 2])} per engine")
