"""``kvrelay bench pool``: how many distinct models of one shape one device serves, and how well, with one
shared memory pool against a static split of the same memory, in the same call.

N models (``--model``, dummy weights, each its own seed: distinct weights of one shape) get a Zipf-like
share of the requests (model i ∝ 1/(i+1)^``--zipf``), which arrive as a Poisson process
(``--request-rate``). One memory budget is used two ways, planned from what a model was measured to take on
this device (bench/pool_memory.py: ``--gpu-memory-utilization`` of the device, or ``--memory``):

* **pool** (what a kvrelay worker does, shared/worker/model_host.py): as many models resident as fit
  over ONE KV pool arbitrated by demand (shared/engine/kv_pool.py), where each model is guaranteed only
  its floor (one max-length sequence) and the room to serve (``--min-kv-seqs`` sequences) is shared: an
  idle model lends its KV to a busy one. A request for a model that is not resident evicts a resident one
  as the worker chooses (shared/worker/eviction.py: idle ones first; a busy one in lower demand, by the
  decayed arrival rate, is drained: it takes no new request, what runs finishes, then it is freed) and
  loads its own (a cold load, counted in its TTFT); while no resident model may go, it waits. Here one
  process sees every arrival, so a cold model's demand is its true rate (a worker adds the requests the
  gateway says wait for the load to what it remembers).
* **static** (one engine per model, as deployed elsewhere): each model a fixed 1/N of the memory for its
  weights and a private KV cache of at least ``--min-kv-seqs`` sequences. Where 1/N cannot hold that,
  the best static split serves the most requested models that fit, 1/k each, and requests for the
  rest fail.

Both run in this one process, models stepped in turn on one thread as a worker steps its models
(bench/pool_steps.py), with async scheduling as a worker's engines have it (on CUDA; ``--async-scheduling``
either way). A cold load runs on a side thread as a worker's does (bench/pool_models.py): weights read while the
others step, then the engine built and warmed up (shared/engine/warmup.py) taking the step lock in pieces: the
pool attach, each CUDA graph's capture, each warm-up shape; the others step between pieces. Each hold is timed,
and the report says how long the loads held the lock, by phase, and how the resident models' steps fared
meanwhile (bench/pool_holds.py). On the CPU a new engine's first steps also pay a first-call cost per shape that
warm-up does not run there, which errs against the pool. The pool mode is bench/pool_shared.py, the static
split bench/pool_static.py.
Unless ``--no-single-baseline``, one model alone then takes every request with all the memory: the
throughput the pool's aggregate is measured against. Prints how many models fit each way, per model TTFT
and TPOT (p50, p99), aggregate output tok/s, the cold loads, goodput (requests with TTFT ≤
``--ttft-slo`` and TPOT ≤ ``--tpot-slo``), the pool/static ratios and the pool against one model alone.
"""

import argparse
import dataclasses
import random

import torch

from kvrelay.bench import pool_memory
from kvrelay.bench.pool_holds import holds_lines, steps_line
from kvrelay.bench.pool_models import Models
from kvrelay.bench.pool_report import ratio, report, size
from kvrelay.bench.pool_shared import PoolRun
from kvrelay.bench.pool_static import StaticRun
from kvrelay.bench.pool_steps import Run
from kvrelay.bench.pool_workload import Arrival, percentile, workload
from kvrelay.shared.engine import KVPool
from kvrelay.shared.worker.model_memory import kv_floor_bytes
from kvrelay.shared.worker.step_lock import HoldTimes, StepLock


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="dummy:tiny-llama", help="dummy:<preset> (each model its own seed)")
    p.add_argument("--load-format", default="dummy", choices=["dummy"], help="weights: random, of the shape")
    p.add_argument("--num-models", type=int, default=4, help="N distinct models")
    pool_memory.add_memory_args(p)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="the engines' async scheduling (default: on for CUDA, as a worker's)")
    p.add_argument("--min-kv-seqs", type=int, default=4,
                   help="max-length sequences of KV a model needs beside its weights to count as fitting")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=16.0, help="requests per second (Poisson)")
    p.add_argument("--zipf", type=float, default=1.0, help="exponent of the popularity of the models")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--ttft-slo", type=float, default=1.0, help="seconds: goodput's TTFT bound")
    p.add_argument("--tpot-slo", type=float, default=0.05, help="seconds: goodput's time-per-output-token bound")
    p.add_argument("--single-baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="also run one model alone on the same arrivals and all the memory (its tok/s)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def run(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    models = Models(args)
    memory, device = models.memory, models.memory.device
    pool_memory.check_memory_args(args, device)
    seq_kv = kv_floor_bytes(models.config(0, None))
    measured = pool_memory.probe(lambda kv: models.load(0, kv_bytes=kv), memory, args.min_kv_seqs * seq_kv)
    total, headroom, how = pool_memory.budget(args, memory, measured, seq_kv)
    p = pool_memory.plan(args, measured, seq_kv, total, headroom)
    if p["resident"] == 0:
        raise SystemExit(f"a budget of {size(total)} ({how}) holds not even one model ({size(measured.model_bytes)}, "
                         f"temporaries {size(measured.peak_bytes)}, headroom {size(headroom)} and "
                         f"{args.min_kv_seqs} x {size(seq_kv)} of KV)")
    arrivals = workload(args, random.Random(args.seed), models_vocab(models))
    print(f"{args.num_models} x {args.model} ({size(measured.weight_bytes)} of weights each, {size(seq_kv)} of KV per "
          f"{args.max_model_len}-token sequence), {size(p['memory'])} in all; {len(arrivals)} requests, "
          f"Poisson {args.request_rate:g}/s, Zipf {args.zipf:g}, {args.input_len} in / {args.output_len} out")
    print(pool_memory.describe(measured, p, how))
    print(f"models that fit: pool {p['resident']} resident of {args.num_models} (one KV pool of "
          f"{size(p['pool_bytes'])}, the rest loaded on demand); static split {p['static_models']} of "
          f"{args.num_models} ({size(p['room'] // max(1, p['static_models']))} each, "
          f"{size(p['static_kv'])} of it KV)")
    by_demand = sorted(range(args.num_models))  # model i is the i-th most requested
    result: dict = {"plan": p, "weight_bytes": measured.weight_bytes}
    frees = len(memory.frees)
    pool = PoolRun(args, models, arrivals, by_demand[:p["resident"]], p["pool_bytes"], device)
    print("pool (one KV pool, eviction and cold loads by demand):")
    result["pool"] = report("pool", args, pool, execute(pool))
    result["pool"].update(evictions=pool.evictions, cold_loads=pool.cold_loads)
    print(pool_memory.frees_line(memory, frees, pool.evictions))
    holds, phases = pool.load_holds, pool.load_phases
    cold = pool.cold_loads or _cold_load(models, device, seq_kv, holds, phases)
    print(f"  cold load of an evicted model: median {percentile(cold, 50):.2f} s, max {max(cold):.2f} s over "
          f"{len(cold)} load(s); {pool.evictions} eviction(s) during the run"
          + ("" if pool.cold_loads else " (none: one load timed after it, alone)"))
    for line in holds_lines(holds, phases):
        print(line)
    print(steps_line(pool.lock_waits, pool.steps, pool.phase_steps))
    result["cold_load_s"] = percentile(cold, 50)
    result["pool"]["holds"] = {"longest_s": max((h.longest()[1] for h in holds), default=0.0),
                               "total_s": percentile([h.total() for h in holds], 50),
                               "lock_wait_s": max(pool.lock_waits, default=0.0)}
    if p["static_models"]:
        static = StaticRun(args, models, arrivals, by_demand[:p["static_models"]], p["static_kv"])
        print(f"static split ({p['static_models']} engines, a fixed share each):")
        result["static"] = report("static", args, static, execute(static))
    else:
        print("static split: no model fits in any share of the memory")
        result["static"] = {"tok_s": 0.0, "goodput_rps": 0.0}
    if args.single_baseline:
        result["single_tok_s"] = _single(args, models, arrivals, p["room"] - p["model_bytes"])
        print(f"one model alone (the same arrivals, all the memory): {result['single_tok_s']:.1f} tok/s; the pool's "
              f"aggregate is {ratio(result['pool']['tok_s'], result['single_tok_s']):.0%} of it")
    ratios = {k: ratio(result["pool"][k], result["static"][k]) for k in ("tok_s", "goodput_rps")}
    result["ratio"] = ratios
    print(f"pool / static: models {p['resident']}/{p['static_models']}, output tok/s {ratios['tok_s']:.2f}x, goodput "
          f"(TTFT <= {args.ttft_slo:g} s, TPOT <= {args.tpot_slo * 1000:g} ms) {ratios['goodput_rps']:.2f}x")
    return result


def execute(mode: Run) -> float:
    """Run one mode and free its engines. An error mid-run is what surfaces: the engines are freed after
    aborting what runs, unchecked (bench/pool_memory.py), rather than refusing and replacing it."""
    try:
        seconds = mode.execute()
    except BaseException:
        mode.close(failed=True)
        raise
    mode.close()
    return seconds


def _single(args: argparse.Namespace, models: Models, arrivals: list[Arrival], kv_bytes: int) -> float:
    """Output tok/s of model 0 alone taking every request: what the pool's aggregate is measured against."""
    alone = StaticRun(args, models, [dataclasses.replace(a, model=0) for a in arrivals], [0], kv_bytes)
    seconds = execute(alone)
    return sum(o.tokens for o in alone.outcomes) / seconds


def models_vocab(models: Models) -> int:
    from kvrelay.shared.config.presets import get_preset

    return int(get_preset(models.path.removeprefix("dummy:"))["vocab_size"])


def _cold_load(models: Models, device: torch.device, seq_kv: int, holds: list[HoldTimes],
               phases: list[dict[str, float]]) -> list[float]:
    """No eviction happened during the run: one model loaded (not the process's first: the probe was) and
    freed, timed, its holds of a step lock no one else wants too."""
    pool = KVPool(2 * seq_kv, device)
    before = len(models.loads)
    holds.append(HoldTimes(StepLock()))
    phases.append({})
    models.free(models.load(0, pool=pool, holds=holds[-1], phases=phases[-1]))
    return models.loads[before:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_args(parser)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
