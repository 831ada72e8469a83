"""The request mix of ``kvrelay bench pool`` (bench/pool_density.py): Poisson arrivals over N models with a
Zipf-like popularity, and what became of each request."""

import argparse
import math
import random
from dataclasses import dataclass


@dataclass
class Arrival:
    at: float  # seconds after the run starts
    model: int  # 0 is the most requested
    prompt: list[int]


@dataclass
class Outcome:
    arrival: Arrival
    arrived: float = 0.0  # perf_counter seconds
    first: float | None = None  # perf_counter seconds of its first token
    last: float = 0.0
    tokens: int = 0
    failed: bool = False

    @property
    def ttft(self) -> float:
        return (self.first or math.inf) - self.arrived

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first."""
        return (self.last - self.first) / (self.tokens - 1) if self.first is not None and self.tokens > 1 else 0.0


def zipf_weights(n: int, exponent: float) -> list[float]:
    raw = [1.0 / (i + 1) ** exponent for i in range(n)]
    total = sum(raw)
    return [w / total for w in raw]


def workload(args: argparse.Namespace, rng: random.Random, vocab: int) -> list[Arrival]:
    weights = zipf_weights(args.num_models, args.zipf)
    at, out = 0.0, []
    for _ in range(args.num_requests):
        at += rng.expovariate(args.request_rate)
        model = rng.choices(range(args.num_models), weights)[0]
        out.append(Arrival(at, model, [rng.randrange(3, vocab) for _ in range(args.input_len)]))
    return out


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank); NaN for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]
