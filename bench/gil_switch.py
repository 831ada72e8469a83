"""What a loading thread's Python costs a serving loop that lets the GIL go at every wait, per switch interval.

A toy of the worker while a model loads: the "step" waits ten times (a GIL-releasing hash and a short sleep,
as a step waits on CUDA and sockets), the "loader" runs pure Python (module construction). Prints the step's
p50 / p99 alone and beside the loader, and the loader's rate, for each interval
(shared/worker/gil_switch.py picks the one loads run under). CPU only.
"""

import argparse
import hashlib
import sys
import threading
import time

from kvrelay.shared.worker.gil_switch import LOAD_SWITCH_INTERVAL_S


def loader(stop: threading.Event, count: list[int]) -> None:
    while not stop.is_set():
        x = 0
        for i in range(1000):
            x += i * i
        count[0] += 1


def step(waits: int) -> None:
    for _ in range(waits):
        hashlib.sha256(b"x" * 20000).digest()  # hashlib releases the GIL over 2 KiB
        time.sleep(0.0001)


def steps_ms(n: int, waits: int) -> tuple[float, float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step(waits)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2], times[min(len(times) - 1, int(len(times) * 0.99))]


def measure(interval_s: float, n: int, waits: int) -> dict:
    saved = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    try:
        alone = steps_ms(n // 3, waits)
        stop, count = threading.Event(), [0]
        t = threading.Thread(target=loader, args=(stop, count))
        t.start()
        t0 = time.perf_counter()
        beside = steps_ms(n, waits)
        stop.set()
        t.join()
        rate = count[0] / (time.perf_counter() - t0)
    finally:
        sys.setswitchinterval(saved)
    return {"interval_ms": interval_s * 1e3, "alone_p50_ms": alone[0], "alone_p99_ms": alone[1],
            "loading_p50_ms": beside[0], "loading_p99_ms": beside[1], "loader_per_s": rate}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--waits", type=int, default=10, help="GIL-releasing waits per step")
    args = p.parse_args(argv)
    rows = [measure(iv, args.steps, args.waits) for iv in sorted({0.005, 0.001, LOAD_SWITCH_INTERVAL_S}, reverse=True)]
    print(f"{'interval ms':>11} {'step alone p50/p99 ms':>22} {'step beside a load p50/p99 ms':>31} {'loader it/s':>12}")
    for r in rows:
        print(f"{r['interval_ms']:>11.1f} {r['alone_p50_ms']:>10.2f} / {r['alone_p99_ms']:<9.2f} "
              f"{r['loading_p50_ms']:>15.2f} / {r['loading_p99_ms']:<13.2f} {r['loader_per_s']:>12.0f}")


if __name__ == "__main__":
    main()
