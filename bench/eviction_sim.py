"""A simulator of the pool's eviction policy (shared/worker/eviction.py) under ``kvrelay bench pool``'s Zipf mix.

It is a model of the policy, not of the GPU: N models, S slots, the bench's seeded workload (bench/pool_workload.py,
the same arrivals as ``bench pool --seed``), each request occupying its model ``--output-len`` x ``--tpot`` seconds
after a ``--prefill-s`` first token, cold loads of ``--load-s`` one at a time, the oldest waiting model's load
first, an idle victim freed at once and a busy one drained, as bench/pool_shared.py does. Time is simulated, in
ticks of ``--tick-s`` (the bench's rounds); the victims are the REAL ``choose_victims`` over the same candidates
and demand the bench builds (``pool_shared.candidates``). What it leaves out: a load's cost to the others' steps,
prefill batching, KV. The GPU bench is what measures; this says which models a policy keeps resident and why.

    python -m kvrelay.bench.eviction_sim --num-models 8 --slots 4 --num-requests 320 --request-rate 8 --load-s 6
"""

import argparse
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay.bench.pool_shared import candidates, incoming
from kvrelay.bench.pool_workload import percentile, workload
from kvrelay.shared.worker.eviction import DemandRate, choose_victims


@dataclass
class Hosted:
    loaded_at: float
    finishes: list[float] = field(default_factory=list)  # its requests' finish times, the unfinished ones

    def busy(self, now: float) -> bool:
        self.finishes = [f for f in self.finishes if f > now]
        return bool(self.finishes)


@dataclass
class Result:
    ttft: dict[int, list[float]]  # model -> its served requests' TTFTs, simulated seconds
    requests: dict[int, int]  # model -> its requests
    loads: dict[int, int]  # model -> cold loads during the run
    order: list[tuple[float, int, int]] = field(default_factory=list)  # (time, victim, loaded for)
    seconds: float = 0.0


class PoolSim:
    """bench/pool_shared.py's PoolRun over simulated time: the same admission, load order and eviction call."""

    def __init__(self, args: argparse.Namespace, vocab: int = 128256):
        self.args = args
        self.arrivals = workload(args, random.Random(args.seed), vocab)
        self.service_s = args.prefill_s + args.output_len * args.tpot
        self.rates = {i: DemandRate() for i in range(args.num_models)}
        self.hosted = {i: Hosted(0.0) for i in range(args.slots)}  # the most requested, as the bench preloads
        self.last_used = dict.fromkeys(self.hosted, 0.0)
        self.draining: set[int] = set()
        self.waiting: dict[int, list[int]] = {}
        self.loading: tuple[int, float] | None = None  # model, when its load ends
        models = range(args.num_models)
        self.result = Result({i: [] for i in models}, {i: sum(a.model == i for a in self.arrivals) for i in models},
                             dict.fromkeys(models, 0))

    def submit(self, k: int, now: float) -> None:
        a = self.arrivals[k]
        self.hosted[a.model].finishes.append(now + self.service_s)
        self.last_used[a.model] = now
        self.result.ttft[a.model].append(now + self.args.prefill_s - a.at)

    def arrive(self, k: int, now: float) -> None:
        m = self.arrivals[k].model
        self.rates[m].note(now)
        if m in self.hosted and m not in self.draining:
            self.submit(k, now)
        else:
            self.waiting.setdefault(m, []).append(k)

    def between_steps(self, now: float) -> None:
        if self.loading is not None:
            m, done = self.loading
            if now < done:
                return
            self.loading = None
            self.hosted[m] = Hosted(now)
            self.result.loads[m] += 1
            for k in self.waiting.pop(m):
                self.submit(k, now)
        for d in [d for d in self.draining if not self.hosted[d].busy(now)]:
            self.draining.discard(d)
            del self.hosted[d]
        waiting = sorted((m for m, ks in self.waiting.items() if ks and m not in self.hosted),
                         key=lambda m: self.waiting[m][0])
        if not waiting or self.draining or (len(self.hosted) >= self.args.slots and not self._evict_one(waiting[0], now)):
            return
        if len(self.hosted) >= self.args.slots:
            return  # the victim drains first
        self.loading = (waiting[0], now + self.args.load_s)

    def _evict_one(self, m: int, now: float) -> bool:
        busy = {i: h.busy(now) for i, h in self.hosted.items()}
        cands = candidates(now, self.args.load_s, self.rates, busy, self.last_used,
                           {i: h.loaded_at for i, h in self.hosted.items()}, self.draining)
        ks = self.waiting[m]
        chosen = choose_victims(cands, 1, 0, incoming(now, m, self.rates, len(ks), self.arrivals[ks[0]].at))
        if not chosen:
            return False
        victim = int(chosen[0].instance)
        self.result.order.append((now, victim, m))
        if chosen[0].idle:
            del self.hosted[victim]
        else:
            self.draining.add(victim)
        return True

    def run(self) -> Result:
        now, nxt, tick = 0.0, 0, self.args.tick_s
        while True:
            while nxt < len(self.arrivals) and self.arrivals[nxt].at <= now:
                self.arrive(nxt, now)
                nxt += 1
            self.between_steps(now)
            busy = False
            for i, h in self.hosted.items():
                if h.busy(now):
                    self.last_used[i], busy = now, True
            if nxt >= len(self.arrivals) and not busy and not any(self.waiting.values()) or now >= self.args.max_s:
                self.result.seconds = now  # past max_s: a load never found room, its requests have no TTFT
                return self.result
            now = round(now + tick, 9)


def table(args: argparse.Namespace, result: Result) -> list[str]:
    total = sum(result.requests.values())
    lines = [f"{'model':>5} {'share':>6} {'served':>6} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'loads':>5}"]
    for m in range(args.num_models):
        t = result.ttft[m]
        lines.append(f"{m:>5} {result.requests[m] / total:>6.1%} {len(t):>6} {percentile(t, 50) * 1000:>12,.0f} "
                     f"{percentile(t, 99) * 1000:>12,.0f} {result.loads[m]:>5}")
    return lines


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-models", type=int, default=8)
    p.add_argument("--slots", type=int, default=4, help="models resident at once")
    p.add_argument("--num-requests", type=int, default=320)
    p.add_argument("--request-rate", type=float, default=8.0, help="requests per second (Poisson)")
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--input-len", type=int, default=512, help="only to draw the same arrivals as bench pool")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--tpot", type=float, default=0.03, help="seconds per output token")
    p.add_argument("--prefill-s", type=float, default=0.08, help="a resident model's TTFT")
    p.add_argument("--load-s", type=float, default=6.0, help="a cold load, one at a time")
    p.add_argument("--tick-s", type=float, default=0.01, help="simulated seconds between two rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-s", type=float, default=3600.0, help="simulated seconds before a starved load is given up")
    p.add_argument("--json", default=None, help="write the per-model TTFTs, loads and evictions here")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    args = parser.parse_args()
    sim = PoolSim(args)
    result = sim.run()
    print(f"simulated: {args.num_models} models, {args.slots} slots, {args.num_requests} requests at "
          f"{args.request_rate:g}/s over {result.seconds:.1f} s, loads of {args.load_s:g} s, service "
          f"{args.prefill_s + args.output_len * args.tpot:.2f} s; {sum(result.loads.values())} loads, "
          f"{len(result.order)} evictions (a model of the policy, not a measurement)")
    for line in table(args, result):
        print(line)
    print("evictions (s: victim -> for): " + ", ".join(f"{t:.1f}: {v}->{m}" for t, v, m in result.order))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "ttft": {str(m): v for m, v in result.ttft.items()}, "requests": {str(m): v for m, v in result.requests.items()},
            "loads": {str(m): v for m, v in result.loads.items()}, "evictions": result.order,
            "last_arrival": sim.arrivals[-1].at}))


if __name__ == "__main__":
    main()
