"""Metrics of a serving run in vLLM benchmark_serving's definitions, key names and printed layout, so
numbers read side by side with vLLM's: TTFT to the first token, TPOT = (E2E - TTFT) / (output - 1) per
request, ITL = every gap between streamed chunks, E2E latency per request."""

import numpy as np

from kvrelay.bench.serve_client import RequestResult

WIDTH = 50
METRICS = (("ttft", "Time to First Token", "TTFT"), ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
           ("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL"))


def summarize(label: str, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    m: dict = {
        "label": label, "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    for key, _title, _short in METRICS:
        ms = np.asarray(values[key], dtype=float) * 1000.0
        empty = ms.size == 0  # e.g. TPOT when every output is one token long
        m[f"mean_{key}_ms"] = 0.0 if empty else float(ms.mean())
        m[f"median_{key}_ms"] = 0.0 if empty else float(np.median(ms))
        m[f"std_{key}_ms"] = 0.0 if empty else float(ms.std())
        m[f"p99_{key}_ms"] = 0.0 if empty else float(np.percentile(ms, 99))
    m.update(input_lens=[r.prompt_tokens for r in results], output_lens=[r.output_tokens for r in results],
             ttfts=[r.ttft for r in results], itls=[r.itl for r in results], errors=[r.error for r in results],
             generated_texts=[r.text for r in results])
    return m


def cold_vs_steady(results: list[RequestResult], first: int) -> dict:
    """TTFT of the first ``first`` requests sent (``results`` in send order) beside the rest's, the steady
    state: median and p99 in ms, and the first's over the rest's (None without a rest). After a fresh
    start the first requests are the ones that meet whatever the server did not prepare before /ready."""
    head, rest = results[:first], results[first:]

    def ms(rs: list[RequestResult]) -> np.ndarray:
        return np.asarray([r.ttft for r in rs if r.success], dtype=float) * 1000.0

    out: dict = {"first": len(head), "rest": len(rest)}
    for name, values in (("first", ms(head)), ("rest", ms(rest))):
        out[f"median_ttft_{name}_ms"] = float(np.median(values)) if values.size else None
        out[f"p99_ttft_{name}_ms"] = float(np.percentile(values, 99)) if values.size else None
    for stat in ("median", "p99"):
        a, b = out[f"{stat}_ttft_first_ms"], out[f"{stat}_ttft_rest_ms"]
        out[f"{stat}_ttft_ratio"] = a / b if a is not None and b else None
    return out


def _row(name: str, value, fmt: str = "<10") -> None:
    print(f"{name:<40} {value:{fmt}}")


def print_result(m: dict, title: str = "Serving Benchmark Result") -> None:
    print(f"{' ' + title + ' ':=^{WIDTH}}")
    _row("Successful requests:", m["completed"])
    _row("Failed requests:", m["failed"])
    _row("Benchmark duration (s):", m["duration"], "<10.2f")
    _row("Total input tokens:", m["total_input_tokens"])
    _row("Total generated tokens:", m["total_output_tokens"])
    _row("Request throughput (req/s):", m["request_throughput"], "<10.2f")
    _row("Output token throughput (tok/s):", m["output_throughput"], "<10.2f")
    _row("Total Token throughput (tok/s):", m["total_token_throughput"], "<10.2f")
    for key, heading, short in METRICS:
        print(f"{heading:-^{WIDTH}}")
        _row(f"Mean {short} (ms):", m[f"mean_{key}_ms"], "<10.2f")
        _row(f"Median {short} (ms):", m[f"median_{key}_ms"], "<10.2f")
        _row(f"P99 {short} (ms):", m[f"p99_{key}_ms"], "<10.2f")
    if "client_cpu_share" in m:
        _row("Client CPU (share of one core):", f"{m['client_cpu_share']:.0%}")
    if "cold_start" in m:
        _print_cold_start(m["cold_start"])
    print("=" * WIDTH)
    failures = [e for e in m["errors"] if e]
    if failures:
        print(f"{len(failures)} failed request(s); distinct errors:")
        for err in sorted(set(failures))[:10]:
            print(f"  {failures.count(err)} x {err}")


def _print_cold_start(c: dict) -> None:
    n = c["first"]
    title = f"First {n} requests {'after /ready' if c['from_ready'] else 'after a warm-up request'} vs the rest"
    print(f"{title:-^{WIDTH}}")
    for stat, label in (("median", "Median"), ("p99", "P99")):
        for part, name in (("first", f"first {n}"), ("rest", f"rest ({c['rest']})")):
            value = c[f"{stat}_ttft_{part}_ms"]
            _row(f"{label} TTFT {name} (ms):", "n/a" if value is None else f"{value:.2f}")
        ratio = c[f"{stat}_ttft_ratio"]
        _row(f"{label} TTFT first / rest:", "n/a" if ratio is None else f"{ratio:.2f}x")


def compare(served: list[dict], offline: dict[str, dict]) -> list[dict]:
    """Each served run against each offline pass: throughput ratio and median-TTFT overhead."""
    rows = []
    for s in served:
        for name, o in offline.items():
            rows.append({
                "served": s["label"], "offline": name,
                "output_throughput_ratio": s["output_throughput"] / o["output_throughput"],
                "median_ttft_overhead_ms": s["median_ttft_ms"] - o["median_ttft_ms"],
                "median_tpot_overhead_ms": s["median_tpot_ms"] - o["median_tpot_ms"],
            })
    return rows


def print_comparison(served: list[dict], offline: dict[str, dict], rows: list[dict]) -> None:
    print(f"{' Served vs offline engine (same run) ':=^{WIDTH + 42}}")
    print(f"{'run':<26}{'out tok/s':>12}{'med TTFT ms':>13}{'P99 TTFT ms':>13}{'med TPOT ms':>13}{'med E2EL ms':>13}")
    for m in [*served, *offline.values()]:
        print(f"{m['label']:<26}{m['output_throughput']:>12.1f}{m['median_ttft_ms']:>13.1f}{m['p99_ttft_ms']:>13.1f}"
              f"{m['median_tpot_ms']:>13.1f}{m['median_e2el_ms']:>13.1f}")
    print(f"{'served':<16}{'vs offline':<26}{'throughput ratio':>18}{'med TTFT +ms':>14}{'med TPOT +ms':>14}")
    for r in rows:
        print(f"{r['served']:<16}{r['offline']:<26}{r['output_throughput_ratio']:>17.2f}x"
              f"{r['median_ttft_overhead_ms']:>14.1f}{r['median_tpot_overhead_ms']:>14.1f}")
    print("=" * (WIDTH + 42))
