"""``kvrelay bench serve --sweep``: goodput, the highest Poisson request rate at which a server holds both
latency SLOs (p99 TTFT and p99 ITL), searched as bench/rate_search.py does, each trial a load of the same
prompts through the bench's own client against one already running server; then the found rate beside
the offline engine's capacity (its requests/s with every prompt at once) on those prompts. Under each
trial's row, the server's own split of that trial's TTFT into stages (bench/ttft_stages.py).

A trial with a failed request fails, whatever its latencies: a server that drops requests meets no SLO.
"""

import uuid
from dataclasses import replace

from kvrelay.bench.serve_client import Prompt, RequestSpec, arrival_offsets, run_load
from kvrelay.bench.serve_metrics import summarize
from kvrelay.bench.ttft_stages import print_breakdown, scrape
from kvrelay.rate_search import SearchSpace, Slo, Trial, next_rate, outcome, verdict
from kvrelay.ttft_readout import breakdown, diff

WIDTH = 92
# what each trial keeps in the result JSON: the per-request lists of summarize() would make a sweep of
# dozens of 200-request trials many MB for nothing the table does not already say
KEPT = ("completed", "failed", "duration", "request_throughput", "output_throughput",
        *(f"{stat}_{key}_ms" for key in ("ttft", "itl", "tpot", "e2el") for stat in ("median", "p99", "mean")))


def _print_header(label: str, slo: Slo) -> None:
    title = f" Goodput sweep ({label}): p99 TTFT <= {slo.ttft_ms:g} ms, p99 ITL <= {slo.itl_ms:g} ms "
    print(f"{title:=^{WIDTH}}")
    print(f"{'trial':>5}{'rate req/s':>12}{'done req/s':>12}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'ITL p50':>10}{'ITL p99':>10}  result", flush=True)


def _print_row(i: int, t: dict) -> None:
    result = "pass" if t["passed"] else "fail (" + ", ".join(t["missed"]) + ")"
    print(f"{i:>5}{t['rate']:>12.2f}{t['request_throughput']:>12.2f}{t['median_ttft_ms']:>10.1f}"
          f"{t['p99_ttft_ms']:>10.1f}{t['median_itl_ms']:>10.2f}{t['p99_itl_ms']:>10.2f}  {result}", flush=True)


async def sweep_server(base_url: str, spec: RequestSpec, prompts: list[Prompt], label: str, slo: Slo,
                       space: SearchSpace, seed: int, max_concurrency: int | None, timeout_s: float,
                       rates: list[float] | None = None) -> dict:
    """The search against one running server; ``spec`` has been warmed already, so no trial warms again.
    Prints the table row by row as trials finish; returns every trial and what the search found. Given
    ``rates``, it tries those in order instead of searching."""
    _print_header(label, slo)
    trials: list[Trial] = []
    records: list[dict] = []

    def next_trial_rate() -> float | None:
        if rates:
            return rates[len(trials)] if len(trials) < len(rates) else None
        return next_rate(trials, space)

    while (rate := next_trial_rate()) is not None:
        # one seed for every trial: the same arrival pattern, only compressed in time as the rate grows
        offsets = arrival_offsets(len(prompts), rate, seed)
        # a fresh salt per trial, so a trial never finds the previous one's prompts in the prefix cache
        trial_spec = replace(spec, cache_salt=uuid.uuid4().hex) if spec.cache_salt is not None else spec
        before = await scrape(base_url)
        results, duration = await run_load(base_url, trial_spec, prompts, offsets, max_concurrency, timeout_s)
        stages = breakdown(diff(before, await scrape(base_url)))
        m = summarize(label, results, duration)
        missed = verdict(m, slo)
        record = {"rate": rate, **{k: m[k] for k in KEPT}, "passed": not missed, "missed": missed,
                  "errors": sorted({e for e in m["errors"] if e})[:5], "ttft_stages": stages}
        trials.append(Trial(rate, record["passed"]))
        records.append(record)
        _print_row(len(records), record)
        print_breakdown(stages)
    found = outcome(trials, space)
    if rates:
        found["stopped"] = "as given"
    print(_found_line(label, found), flush=True)
    return {"label": label, "base_url": base_url, "model_id": spec.model, **found, "trials": records}


def _found_line(label: str, found: dict) -> str:
    rate, fail = found["found_rate"], found["lowest_failing_rate"]
    if rate is None:
        return f"{label}: no rate met the SLOs (lowest tried {fail:g} req/s; {found['stopped']})"
    bound = f"fails at {fail:g}" if fail is not None else "no rate tried failed: a lower bound"
    return f"{label}: highest rate meeting the SLOs {rate:g} req/s ({bound}; {found['stopped']})"


def print_summary(modes: list[dict], offline_rps: float | None) -> None:
    """The found rate per mode and, given the offline engine's requests/s, each as a fraction of it."""
    print(f"{' Goodput: highest rate meeting the SLOs ':=^{WIDTH}}")
    print(f"{'mode':<20}{'found req/s':>12}{'fails at':>10}{'trials':>8}{'stopped':>11}{'offline req/s':>15}"
          f"{'fraction':>10}")
    for m in modes:
        rate, fail = m["found_rate"], m["lowest_failing_rate"]
        m["offline_fraction"] = rate / offline_rps if rate is not None and offline_rps else None
        frac = "n/a" if m["offline_fraction"] is None else f"{m['offline_fraction']:.2f}x"
        print(f"{m['label']:<20}{'none' if rate is None else f'{rate:g}':>12}{'-' if fail is None else f'{fail:g}':>10}"
              f"{m['trials_run']:>8}{m['stopped']:>11}{'n/a' if offline_rps is None else f'{offline_rps:.2f}':>15}"
              f"{frac:>10}")
    print("=" * WIDTH, flush=True)
