"""The goodput sweep's search (``kvrelay bench serve --sweep``): the highest request rate at which a trial
passes, found by doubling from a start rate until a trial fails, then bisecting between the best pass and
the lowest fail down to a resolution, never running more than a given number of trials. A start that
already fails halves the rate (doubling down) until a trial passes, the rate would drop below a floor,
or below the resolution, whichever comes first: a trial's length grows as 1 / rate, so the floor is what
keeps a server that misses the SLOs at every rate from costing minutes per halving.

Pure functions of the trials so far (kept outside bench/, which tests never import), so the search is tested
without a server and the sweep's driver is
a plain loop: ``while (rate := next_rate(trials, ...)) is not None: trials.append(Trial(rate, run(rate)))``.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Trial:
    rate: float  # requests/s offered
    passed: bool


@dataclass(frozen=True)
class SearchSpace:
    start: float  # the first rate tried, req/s
    resolution: float  # stop once the lowest failing rate is this close above the best passing one
    max_trials: int  # a cap on trials, so a noisy or never-failing server cannot make a sweep run forever
    min_rate: float = 0.0  # never try a rate below this (0: halve down to the resolution)

    def check(self) -> None:
        if not self.start > 0:
            raise ValueError(f"--sweep-start must be positive, got {self.start}")
        if not self.resolution > 0:
            raise ValueError(f"--sweep-resolution must be positive, got {self.resolution}")
        if self.max_trials < 1:
            raise ValueError(f"--sweep-max-trials must be at least 1, got {self.max_trials}")
        if not 0 <= self.min_rate <= self.start:
            raise ValueError(f"--sweep-min-rate must be between 0 and --sweep-start, got {self.min_rate}")


def bounds(trials: list[Trial]) -> tuple[float | None, float | None]:
    """(best passing rate below the lowest failing one, lowest failing rate); None where there is none.
    A pass above a fail (noise at the edge) is not trusted: the search keeps below the lowest fail."""
    fails = [t.rate for t in trials if not t.passed]
    hi = min(fails) if fails else None
    passes = [t.rate for t in trials if t.passed and (hi is None or t.rate < hi)]
    return (max(passes) if passes else None), hi


def next_rate(trials: list[Trial], space: SearchSpace) -> float | None:
    """The rate of the next trial, or None when the search is done (resolved, or out of trials)."""
    if len(trials) >= space.max_trials:
        return None
    if not trials:
        return space.start
    lo, hi = bounds(trials)
    if hi is None:  # every trial passed: no upper bound yet
        return 2 * lo
    if lo is None:  # even the start failed: halve, as far as the floor and the resolution allow
        if hi <= space.min_rate or hi <= space.resolution:
            return None
        return max(hi / 2, space.min_rate)
    if hi - lo <= space.resolution:
        return None
    return (lo + hi) / 2


def outcome(trials: list[Trial], space: SearchSpace) -> dict:
    """What the search found: ``found_rate`` (None: no trial passed), ``lowest_failing_rate`` (None: no
    trial failed, so ``found_rate`` is only a lower bound) and why it stopped."""
    lo, hi = bounds(trials)
    if lo is None:  # nothing passed: resolved once the halving reached its end
        resolved = hi is not None and (hi <= space.min_rate or hi <= space.resolution)
    else:
        resolved = hi is not None and hi - lo <= space.resolution
    return {"found_rate": lo, "lowest_failing_rate": hi, "trials_run": len(trials),
            "stopped": "resolved" if resolved else "trial cap"}


@dataclass(frozen=True)
class Slo:
    ttft_ms: float  # p99 time to first token
    itl_ms: float  # p99 inter-token latency

    def check(self) -> None:
        if not (self.ttft_ms > 0 and self.itl_ms > 0):
            raise ValueError("--slo-ttft-ms and --slo-itl-ms must be positive")


def verdict(m: dict, slo: Slo) -> list[str]:
    """Why a trial's metrics (summarize()'s dict) miss the SLOs; empty when it passes."""
    why = []
    if m["failed"]:
        why.append(f"{m['failed']} failed")
    if m["completed"] == 0:
        return why or ["none completed"]
    if m["p99_ttft_ms"] > slo.ttft_ms:
        why.append("TTFT")
    if m["p99_itl_ms"] > slo.itl_ms:
        why.append("ITL")
    return why
