"""The table of bench/h200_gpu_share.sh: per ``--gpu-share`` mode, the highest Poisson rate its sweep found
meeting the SLOs and the p50 / p99 TTFT and ITL of its trials at the rates asked for (``-`` where the search
tried no such rate), beside the offline engine's requests/s on the same prompts.

``python3 -m kvrelay.bench.gpu_share_report DIR MODE...``: reads DIR/goodput-MODE.json (``kvrelay bench serve
--sweep --json``); a mode without one (it did not start, or ran out of time) prints the last line its log
DIR/goodput-MODE.txt has that says why."""

import json
import sys
from pathlib import Path

from kvrelay.rate_search import Trial, bounds

RATES = (12.0, 16.0, 24.0)


def mode_row(out: Path, mode: str) -> str:
    result, log = out / f"goodput-{mode}.json", out / f"goodput-{mode}.txt"
    if result.exists():
        (served,) = json.loads(result.read_text())["sweep"]["modes"]
        found, trials, partial = served["found_rate"], served["trials"], ""
    else:  # stopped by its time limit: the trials it printed before
        trials = _printed_trials(log)
        if not trials:
            return f"{mode:<10} no result: {_why(log)}"
        found, _ = bounds([Trial(t["rate"], t["passed"]) for t in trials])
        partial = "  (cut short: the trials it finished)"
    cells = [f"{'none' if found is None else f'{found:g}':>7}"]
    for rate in RATES:
        trial = next((t for t in trials if t["rate"] == rate), None)
        cells.append(f"{'-':>31}" if trial is None else
                     f"  {trial['median_ttft_ms']:>7.0f} /{trial['p99_ttft_ms']:>6.0f}{trial['median_itl_ms']:>7.1f} /"
                     f"{trial['p99_itl_ms']:>5.1f}")
    return f"{mode:<10}" + "".join(cells) + partial


def _printed_trials(log: Path) -> list[dict]:
    """The rows bench/serve_sweep.py prints as each trial ends: trial, rate, done, TTFT p50, p99, ITL p50, p99."""
    trials = []
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        cols = line.split()
        if len(cols) >= 8 and cols[0].isdigit() and cols[7] in ("pass", "fail"):
            rate, _, ttft50, ttft99, itl50, itl99 = map(float, cols[1:7])
            trials.append({"rate": rate, "median_ttft_ms": ttft50, "p99_ttft_ms": ttft99, "median_itl_ms": itl50,
                           "p99_itl_ms": itl99, "passed": cols[7] == "pass"})
    return trials


def offline_rps(out: Path, modes: list[str]) -> float | None:
    for mode in modes:
        result = out / f"goodput-{mode}.json"
        if result.exists() and (offline := json.loads(result.read_text())["sweep"].get("offline")):
            return offline["request_throughput"]
    return None


def _why(log: Path) -> str:
    if not log.exists():
        return "no log"
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    said = [ln for ln in lines if "error" in ln.lower() or "did not become ready" in ln]
    return (said or lines or ["empty log"])[-1][:300]


def main(argv: list[str]) -> int:
    out, modes = Path(argv[0]), argv[1:]
    rates = "".join(f"{f'@{r:g}: TTFT p50/p99 ITL p50/p99':>31}" for r in RATES)
    print(f"{'mode':<10}{'found':>7}{rates}  (req/s; ms)")
    for mode in modes:
        print(mode_row(out, mode))
    rps = offline_rps(out, modes)
    print(f"offline engine, all prompts at once: {'n/a' if rps is None else f'{rps:.2f}'} req/s; found: the highest "
          "rate tried with p99 TTFT and p99 ITL within the SLOs")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
