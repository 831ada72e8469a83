"""One line per step kind from a worker's /metrics text (kvrelay_engine_step_seconds, kvrelay_engine_step_prompt_tokens),
as the difference between two scrapes of one server: what one load level added. For bench/h200_prefill_budget.sh,
which scrapes after each rate.

    python -m kvrelay.bench.step_metrics AFTER.metrics [BEFORE.metrics]

Quantiles are the upper bound of the histogram bucket they fall in (the buckets are 2.5-5 ms wide in 10-40 ms).
"""

import argparse
import math
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

STEP = "kvrelay_engine_step_seconds"
PROMPT = "kvrelay_engine_step_prompt_tokens"


def read(path: str | None) -> dict[tuple, float]:
    if path is None or not Path(path).exists():
        return {}
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(Path(path).read_text()) for s in fam.samples}


def histogram(after: dict, before: dict, name: str, **match: str) -> tuple[list[tuple[float, float]], float, float]:
    """(cumulative (bound, count) pairs, count, sum) of ``name``'s series matching ``match``, after minus before."""
    def pick(snap: dict, suffix: str) -> dict[float, float]:
        out = {}
        for (n, labels), v in snap.items():
            d = dict(labels)
            if n == name + suffix and all(d.get(k) == w for k, w in match.items()):
                out[float(d.get("le", "nan"))] = out.get(float(d.get("le", "nan")), 0.0) + v
        return out
    a, b = pick(after, "_bucket"), pick(before, "_bucket")
    buckets = sorted((le, a[le] - b.get(le, 0.0)) for le in a)
    count = sum(pick(after, "_count").values()) - sum(pick(before, "_count").values())
    total = sum(pick(after, "_sum").values()) - sum(pick(before, "_sum").values())
    return buckets, count, total


def quantile(buckets: list[tuple[float, float]], count: float, q: float) -> float:
    for bound, cum in buckets:
        if cum >= q * count:
            return bound
    return math.inf


def lines(after: dict, before: dict) -> list[str]:
    out = []
    for kind in ("decode", "mixed", "prefill"):
        buckets, n, total = histogram(after, before, STEP, kind=kind)
        if n:
            out.append(f"step {kind:<7} {int(n):>6} steps, mean {total / n * 1e3:6.1f} ms, p50 <= "
                       f"{quantile(buckets, n, 0.5) * 1e3:g} ms, p99 <= {quantile(buckets, n, 0.99) * 1e3:g} ms")
    buckets, n, total = histogram(after, before, PROMPT)
    if n:
        zero = next((c for le, c in buckets if le == 0), 0.0)
        out.append(f"steps with decodes {int(n)}: {(n - zero) / n:.0%} held prompt tokens, mean {total / n:.0f} "
                   f"tokens a step, p99 <= {quantile(buckets, n, 0.99):g}")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("after")
    p.add_argument("before", nargs="?")
    args = p.parse_args(argv)
    print("\n".join(lines(read(args.after), read(args.before))) or "no step histograms in the scrape")


if __name__ == "__main__":
    main()
