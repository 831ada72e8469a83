"""What ``kvrelay bench pool`` (bench/pool_density.py) prints for one mode: totals, goodput and a per-model
TTFT/TPOT table, and the sizes and ratios of its summary lines."""

import argparse

from kvrelay.bench.pool_workload import percentile


def report(name: str, args: argparse.Namespace, run, seconds: float) -> dict:
    """Print one mode's totals and its per-model TTFT/TPOT table; the same as a dict."""
    # goodput over the arrivals' span, the same in both modes: a run that ends later for its slow requests
    # must not look worse per second for the ones it served well
    span = max(run.arrivals[-1].at, 1e-9)
    done = [o for o in run.outcomes if o.first is not None]
    tokens = sum(o.tokens for o in done)
    good = [o for o in done if o.ttft <= args.ttft_slo and o.tpot <= args.tpot_slo]
    failed = sum(o.failed for o in run.outcomes)
    print(f"  {name}: {tokens} output tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s; goodput "
          f"{len(good)}/{len(run.outcomes)} requests = {len(good) / span:.2f} req/s over the {span:.2f} s of arrivals"
          + (f"; {failed} failed (no engine for their model)" if failed else ""))
    print(f"  {'model':>7} {'share':>6} {'reqs':>5} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>8}  (ms)")
    per_model = {}
    for i in range(args.num_models):
        mine = [o for o in done if o.arrival.model == i]
        n_all = sum(o.arrival.model == i for o in run.outcomes)
        row = {"requests": n_all, "served": len(mine),
               "ttft_p50": percentile([o.ttft for o in mine], 50), "ttft_p99": percentile([o.ttft for o in mine], 99),
               "tpot_p50": percentile([o.tpot for o in mine], 50), "tpot_p99": percentile([o.tpot for o in mine], 99)}
        per_model[i] = row
        cells = " ".join(f"{row[k] * 1000:>9.1f}" if row[k] == row[k] else f"{'-':>9}"
                         for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99"))
        print(f"  {i:>7} {n_all / max(1, len(run.outcomes)):>6.1%} {n_all:>5} {cells}")
    return {"seconds": seconds, "tok_s": tokens / seconds, "goodput_rps": len(good) / span,
            "good": len(good), "failed": failed, "models": per_model}


def ratio(pool: float, static: float) -> float:
    if static:
        return pool / static
    return float("inf") if pool else float("nan")  # nan: neither served a request well


def size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
