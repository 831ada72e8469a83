"""Where a served run's long inter-token gaps come from, from its ``bench serve --json`` result alone (no device):
every token's time is rebuilt on one clock (send offsets from the run's seed and rate, as the client drew them, plus
each request's TTFT and ITLs), and each gap over ``--long-ms`` is checked for another request's first token within
``--slack-ms`` of its end (a step that finished a prompt ended it). Also how long gaps come in a row (a stall
seen as one gap, or split in two where async scheduling reads a decode step after the next step's eager launch).

    python -m kvrelay.bench.itl_gaps RESULT.json [--long-ms 20] [--slack-ms 10]

Send times are the schedule's, not when asyncio really sent, hence the slack.
"""

import argparse
import bisect
import collections
import json

from kvrelay.bench.serve_client import arrival_offsets


def timelines(run: dict, offsets: list[float]) -> list[list[float]]:
    """Each request's token times (seconds on the client's clock from the first send)."""
    out = []
    for offset, ttft, itls in zip(offsets, run["ttfts"], run["itls"], strict=True):
        t = offset + ttft
        times = [t]
        for gap in itls:
            t += gap
            times.append(t)
        out.append(times)
    return out


def quantiles(values: list[float]) -> str:
    if not values:
        return "none"
    v = sorted(values)
    return " / ".join(f"{v[min(len(v) - 1, int(q * len(v)))]:.1f}" for q in (0.5, 0.9, 0.99))


def report(result: dict, long_ms: float, slack_ms: float) -> list[str]:
    config, run = result["config"], result["runs"][0]
    offsets = arrival_offsets(len(run["ttfts"]), config["request_rate"], config["seed"])
    lines = timelines(run, offsets)
    firsts = sorted(times[0] for times in lines)
    slack = slack_ms / 1e3
    with_prefill, without, runs = [], [], collections.Counter()
    for times in lines:
        streak = 0
        for a, b in zip(times, times[1:], strict=False):
            gap = (b - a) * 1e3
            if gap <= long_ms:
                if streak:
                    runs[min(streak, 4)] += 1
                streak = 0
                continue
            streak += 1
            near = bisect.bisect_right(firsts, b + slack) - bisect.bisect_left(firsts, b - slack)
            (with_prefill if near and times[0] != b else without).append(gap)
        if streak:
            runs[min(streak, 4)] += 1
    gaps = [(b - a) * 1e3 for times in lines for a, b in zip(times, times[1:], strict=False)]
    n_long = len(with_prefill) + len(without)
    return [
        f"rate {config['request_rate']} req/s, {len(lines)} requests, {len(gaps)} gaps; ITL p50 / p90 / p99 (ms) "
        f"{quantiles(gaps)}",
        f"gaps > {long_ms:g} ms: {n_long} ({n_long / max(1, len(gaps)):.1%}); ending within {slack_ms:g} ms of "
        f"another request's first token: {len(with_prefill)} (p50 / p90 / p99 {quantiles(with_prefill)} ms), "
        f"not: {len(without)} ({quantiles(without)} ms)",
        "long gaps in a row (1, 2, 3, 4+): " + ", ".join(str(runs[k]) for k in (1, 2, 3, 4)),
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("result", nargs="+")
    p.add_argument("--long-ms", type=float, default=20.0)
    p.add_argument("--slack-ms", type=float, default=10.0)
    args = p.parse_args(argv)
    for path in args.result:
        with open(path) as f:
            result = json.load(f)
        print(path)
        for line in report(result, args.long_ms, args.slack_ms):
            print("  " + line)


if __name__ == "__main__":
    main()
