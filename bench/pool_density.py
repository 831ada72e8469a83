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

Both run in this one process, models stepped in turn on one thread as a worker steps its models, with async
scheduling as a worker's engines have it (on CUDA; ``--async-scheduling`` either way). A cold
load runs on a side thread as a worker's does: weights read while the others step, the engine built and
warmed up (shared/engine/warmup.py) under the step lock, shape by shape. On the CPU a new engine's first
steps also pay a first-call cost per shape that warm-up does not run there, which errs against the pool.
Unless ``--no-single-baseline``, one model alone then takes every request with all the memory: the
throughput the pool's aggregate is measured against. Prints how many models fit each way, per model TTFT
and TPOT (p50, p99), aggregate output tok/s, the cold loads, goodput (requests with TTFT ≤
``--ttft-slo`` and TPOT ≤ ``--tpot-slo``), the pool/static ratios and the pool against one model alone.
"""

import argparse
import contextlib
import dataclasses
import logging
import random
import threading
import time

import torch

from kvrelay.bench import pool_memory
from kvrelay.bench.pool_report import ratio, report, size
from kvrelay.bench.pool_workload import Arrival, Outcome, percentile, workload
from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvrelay.shared.engine import EngineCore, KVPool
from kvrelay.shared.engine.kv_pool import KVPoolFull
from kvrelay.shared.engine.loader import load_model
from kvrelay.shared.engine.warmup import warm_up
from kvrelay.shared.repo.model_source import resolve_model
from kvrelay.shared.wire.sampling_params import SamplingParams
from kvrelay.shared.worker.eviction import Candidate, DemandRate, Incoming, choose_victims
from kvrelay.shared.worker.load_room import IDLE_GRACE_S
from kvrelay.shared.worker.model_memory import kv_floor_bytes

log = logging.getLogger(__name__)


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


class Models:
    """Builds and frees the N models' engines: model i is ``--model`` with dummy weights of seed ``seed+i``."""

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

    def load(self, i: int, kv_bytes: int | None = None, pool: KVPool | None = None,
             lock: contextlib.AbstractContextManager | None = None) -> EngineCore:
        """Weights first, then (holding ``lock``, the step lock, as a worker does) the engine and its KV, and
        the warm-up shape by shape."""
        t0 = time.perf_counter()
        config = self.config(i, kv_bytes)
        loaded = load_model(config.model, config.device, progress=False)
        self.memory.load_transient = self.memory.transient()
        cuda = torch.device(config.device).type == "cuda"
        with lock or contextlib.nullcontext():
            core = EngineCore(config, kv_pool=pool, kv_pool_key=f"model-{i}" if pool else None, loaded=loaded)
        warm_up(core, compiles=cuda, hold=lock)
        if cuda:
            torch.cuda.synchronize()
        self.loads.append(time.perf_counter() - t0)
        return core


class Run:
    """One mode's pass over the workload: engines stepped in turn, token times recorded per request."""

    def __init__(self, args: argparse.Namespace, models: Models, arrivals: list[Arrival]):
        self.args, self.models, self.arrivals = args, models, arrivals
        self.cores: dict[int, EngineCore] = {}
        self.outcomes = [Outcome(a) for a in arrivals]
        self._by_id = {f"r{k}": o for k, o in enumerate(self.outcomes)}
        self.waiting: dict[int, list[int]] = {}  # model -> request indexes waiting for its load
        self.last_used: dict[int, float] = {}
        self.params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        self.t0 = 0.0
        self.lock = threading.Lock()  # the step lock: a side thread's load takes it between steps

    def submit(self, k: int) -> None:
        a = self.arrivals[k]
        core = self.cores[a.model]
        core.add_request(core.make_request(f"r{k}", a.prompt, self.params))
        self.last_used[a.model] = time.perf_counter()

    def arrive(self, k: int) -> None:  # the mode's admission: subclasses
        raise NotImplementedError

    def between_steps(self) -> None:
        pass

    def execute(self) -> float:
        self.t0 = time.perf_counter()
        self.last_used = dict.fromkeys(self.cores, self.t0)  # the preloaded models start the run just used
        nxt = 0
        while True:
            now = time.perf_counter() - self.t0
            while nxt < len(self.arrivals) and self.arrivals[nxt].at <= now:
                self.outcomes[nxt].arrived = self.t0 + self.arrivals[nxt].at
                self.arrive(nxt)
                nxt += 1
            self.between_steps()
            busy = self.step_all()
            if nxt >= len(self.arrivals) and not busy and not any(self.waiting.values()):
                return time.perf_counter() - self.t0
            if not busy:  # the next arrival, or a load finishing
                wait = self.arrivals[nxt].at - (time.perf_counter() - self.t0) if nxt < len(self.arrivals) else 0.01
                time.sleep(max(0.0, min(0.01, wait)))

    def step_all(self) -> bool:
        """One step of each model that has work, in turn; whether any had. A frame of its own: a loop variable
        left in ``execute`` would hold the last core it stepped through ``between_steps``, which may evict it."""
        busy = False
        for i in list(self.cores):
            if not self.cores[i].has_unfinished():
                continue
            busy = True
            with self.lock:
                outs = self.cores[i].step()
            for out in outs:
                o = self._by_id[out.request_id]
                if out.new_token_ids:
                    t = time.perf_counter()
                    o.first = o.first or t
                    o.last, o.tokens = t, o.tokens + len(out.new_token_ids)
            self.last_used[i] = time.perf_counter()
        return busy

    def close(self, failed: bool = False) -> None:
        """Free every engine. ``failed``: after an error mid-run, which is the one to report: what runs is
        aborted first (a release refuses while requests hold KV), the release is not checked (the error's
        traceback holds the frames that stepped the engines), and what still goes wrong is logged, not raised."""
        for i in list(self.cores):
            if not failed:
                self.models.free(self.cores.pop(i))
                continue
            try:
                self.cores[i].abort_all()
                self.models.free(self.cores.pop(i), checked=False)
            except Exception as exc:
                log.warning("model %d not freed after the run's error: %s", i, exc)
                self.cores.pop(i, None)


class StaticRun(Run):
    def __init__(self, args, models, arrivals, served: list[int], kv_bytes: int):
        super().__init__(args, models, arrivals)
        for i in served:
            self.cores[i] = models.load(i, kv_bytes=kv_bytes)

    def arrive(self, k: int) -> None:
        if self.arrivals[k].model in self.cores:
            self.submit(k)
        else:
            self.outcomes[k].failed = True  # no engine for it: the split had no room


class PoolRun(Run):
    def __init__(self, args, models, arrivals, resident: list[int], pool_bytes: int, device: torch.device):
        super().__init__(args, models, arrivals)
        self.slots = len(resident)
        self.pool = KVPool(pool_bytes, device)
        self.evictions = 0
        self.cold_loads: list[float] = []  # loads during the run: an evicted model coming back
        self._loading: tuple[int, threading.Thread, dict] | None = None  # model, its loading thread, result
        self.rates = {i: DemandRate() for i in range(args.num_models)}  # arrivals per second, decayed
        self.loaded_at: dict[int, float] = {}
        self.draining: set[int] = set()  # evicted while busy: no new request, freed once what runs finished
        for i in resident:
            self.cores[i] = models.load(i, pool=self.pool)
            self.loaded_at[i] = time.perf_counter()

    def arrive(self, k: int) -> None:
        m = self.arrivals[k].model
        self.rates[m].note(time.perf_counter())
        if m in self.cores and m not in self.draining:
            self.submit(k)
        else:
            self.waiting.setdefault(m, []).append(k)

    def between_steps(self) -> None:
        if self._loading is not None:
            m, thread, result = self._loading
            if thread.is_alive():
                return
            self._loading = None
            if isinstance(result.get("error"), KVPoolFull):
                # the others' KV was in use; tried again next time round. The error's traceback holds the
                # frames of the load, and so its weights, in a cycle with ``result``: broken, and collected
                result.pop("error").__traceback__ = None
                self.models.memory.settle()
                return
            if "error" in result:
                raise result["error"]
            self.cores[m] = result.pop("core")  # the only reference: it may be evicted in this very call
            self.loaded_at[m] = time.perf_counter()
            self.cold_loads.append(result["seconds"])
            for k in self.waiting.pop(m):
                self.submit(k)
        for d in [d for d in self.draining if not self.cores[d].has_unfinished()]:
            self.draining.discard(d)
            self.models.free(self.cores.pop(d))  # what arrived while it drained waits for its reload
        waiting = sorted((m for m, ks in self.waiting.items() if ks and m not in self.cores),
                         key=lambda m: self.waiting[m][0])
        if not waiting or self.draining or (len(self.cores) >= self.slots and not self._evict_one(waiting[0])):
            return  # nothing to load, a victim still draining, or no resident model may go yet
        if len(self.cores) >= self.slots:
            return  # the victim drains first
        m, result = waiting[0], {}
        thread = threading.Thread(target=self._load, args=(m, result), daemon=True, name=f"load-{m}")
        self._loading = (m, thread, result)
        thread.start()

    def _load(self, m: int, result: dict) -> None:
        t0 = time.perf_counter()
        try:
            result["core"] = self.models.load(m, pool=self.pool, lock=self.lock)
        except Exception as exc:  # handed to the stepping thread, which raises it
            result["error"] = exc
        result["seconds"] = time.perf_counter() - t0

    def close(self, failed: bool = False) -> None:
        if self._loading is not None:  # a load in flight when the run failed: it ends, then goes too
            m, thread, result = self._loading
            self._loading = None
            thread.join()
            if "core" in result:
                self.cores[m] = result.pop("core")
        super().close(failed)
        self.pool = None  # its buffer too, before the static split's engines take the same memory
        self.models.memory.settle()

    def _evict_one(self, m: int) -> bool:
        """Room for ``m``'s load, as the worker chooses its victim (shared/worker/eviction.py): an idle one is
        freed now, a busy one starts draining. False: none may go (yet)."""
        now = time.perf_counter()
        reload_s = percentile(self.models.loads, 50) if self.models.loads else 1.0
        candidates = [Candidate(instance=str(i), weight_bytes=1, kv_bytes=0, reload_s=reload_s,
                                demand=self.rates[i].rate(now), resident_s=now - self.loaded_at.get(i, now),
                                idle=not c.has_unfinished() and now - self.last_used.get(i, 0.0) > IDLE_GRACE_S,
                                idle_s=now - self.last_used.get(i, 0.0), ready=i not in self.draining)
                      for i, c in self.cores.items()]
        chosen = choose_victims(candidates, 1, 0, Incoming(self.rates[m].rate(now), len(self.waiting[m])))
        if not chosen:
            return False
        victim = int(chosen[0].instance)
        self.evictions += 1
        if chosen[0].idle:
            self.models.free(self.cores.pop(victim))
        else:
            self.draining.add(victim)
        return True


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
    cold = pool.cold_loads or _cold_load(models, device, seq_kv)
    print(f"  cold load of an evicted model: median {percentile(cold, 50):.2f} s, max {max(cold):.2f} s over "
          f"{len(cold)} load(s); {pool.evictions} eviction(s) during the run")
    result["cold_load_s"] = percentile(cold, 50)
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


def _cold_load(models: Models, device: torch.device, seq_kv: int) -> list[float]:
    """No eviction happened during the run: one model loaded (not the process's first: the probe was) and
    freed, timed."""
    pool = KVPool(2 * seq_kv, device)
    before = len(models.loads)
    models.free(models.load(0, pool=pool))
    return models.loads[before:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_args(parser)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
