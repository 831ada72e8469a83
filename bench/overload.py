"""Overload: more concurrent streams than decode seats. One gateway, one prefill and one decode worker
(``--max-num-seqs`` SEATS on the decode worker), every role its own process (kvrelay/local_cluster.py).
The same workload of streamed completions runs at a concurrency equal to the seats (no overload), then
at FACTOR times that; each request's time to its first token (TTFT), to its second token, and to its
last is measured at the client, with how many completed, and how many prefilled requests waited for a
decode seat (the prefill worker's ``kvrelay_handoff_seat_wait_seconds``).

The first token comes from the prefill worker, so a full decode batch shows little in TTFT: a
prefilled request waits for a seat after its first token, which shows as the gap to its second.

    python -m kvrelay.bench.overload [--model dummy:tiny-llama] [--seats 4] [--factor 4] [--requests 48]
"""

import argparse
import asyncio
import random
import tempfile
import time
import urllib.request
from pathlib import Path

import openai

from kvrelay.local_cluster import LocalCluster, free_port
from kvrelay.shared.wire.redis_conn import EmbeddedRedis


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def _seat_waits(port: int) -> tuple[float, float]:
    """(count, sum of seconds) of kvrelay_handoff_seat_wait_seconds on the prefill worker."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    count = total = 0.0
    for line in text.splitlines():
        if line.startswith("kvrelay_handoff_seat_wait_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvrelay_handoff_seat_wait_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
    return count, total


async def _one(client: openai.AsyncOpenAI, model: str, prompt: list[int], max_tokens: int) -> dict:
    start = time.perf_counter()
    stamps: list[float] = []
    usage = None
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                 logprobs=0, extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.tokens:
                stamps += [time.perf_counter() - start] * len(chunk.choices[0].logprobs.tokens)
    except openai.APIError as exc:
        return {"ok": False, "error": str(exc)[:200]}
    ok = usage is not None and usage.completion_tokens == max_tokens and len(stamps) >= 2
    return {"ok": ok, "ttft": stamps[0] if stamps else None, "t2": stamps[1] if len(stamps) > 1 else None,
            "e2e": stamps[-1] if stamps else None, "error": "" if ok else f"{usage} / {len(stamps)} tokens"}


async def run_wave(base_url: str, concurrency: int, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    gate = asyncio.Semaphore(concurrency)

    async def gated(prompt: list[int]) -> dict:
        async with gate:
            return await _one(client, model, prompt, max_tokens)

    return await asyncio.gather(*(gated(p) for p in prompts))


def report(label: str, concurrency: int, results: list[dict], waits: tuple[float, float], wall_s: float) -> None:
    ok = [r for r in results if r["ok"]]
    ms = {k: [r[k] * 1000 for r in ok] for k in ("ttft", "t2", "e2e")}
    print(f"| {label} | {concurrency} | {len(ok)}/{len(results)} | {_pct(ms['ttft'], 0.5):.0f} | "
          f"{_pct(ms['ttft'], 0.99):.0f} | {_pct(ms['t2'], 0.5):.0f} | {_pct(ms['t2'], 0.99):.0f} | "
          f"{_pct(ms['e2e'], 0.5):.0f} | {_pct(ms['e2e'], 0.99):.0f} | {int(waits[0])} | "
          f"{waits[1] / max(waits[0], 1):.2f} | {wall_s:.1f} |", flush=True)
    for r in results:
        if not r["ok"]:
            print(f"  failed: {r['error']}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:tiny-llama")
    p.add_argument("--seats", type=int, default=4, help="the decode worker's --max-num-seqs")
    p.add_argument("--factor", type=int, default=4, help="overload: this many times more streams than seats")
    p.add_argument("--requests", type=int, default=48, help="streams per wave")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("engine_args", nargs="*", help="after --: engine flags for every worker")
    args = p.parse_args()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 500) for _ in range(args.input_len)] for _ in range(args.requests)]
    with EmbeddedRedis() as redis_url, tempfile.TemporaryDirectory() as logs:
        c = LocalCluster(redis_url, Path(logs), cli_flags=["--log-level", "WARNING"])
        port = free_port()
        try:
            c.start_gateway()
            c.start_worker("prefill", "p1", args.model, [*args.engine_args, "--monitoring-port", str(port)])
            c.start_worker("decode", "d1", args.model, [*args.engine_args, "--max-num-seqs", str(args.seats)])
            c.wait_ready(timeout=300)
            asyncio.run(run_wave(c.base_url(), args.seats, prompts[: args.seats], args.output_len))  # warm-up
            print("| load | concurrent streams | completed | TTFT p50 ms | TTFT p99 ms | 2nd token p50 ms | "
                  "2nd token p99 ms | last token p50 ms | last token p99 ms | waited for a seat | "
                  "mean seat wait s | wall s |")
            print("|---|---|---|---|---|---|---|---|---|---|---|---|")
            for label, concurrency in (("no overload", args.seats), (f"{args.factor}x overload",
                                                                      args.seats * args.factor)):
                before = _seat_waits(port)
                start = time.perf_counter()
                results = asyncio.run(run_wave(c.base_url(), concurrency, prompts, args.output_len))
                wall = time.perf_counter() - start
                after = _seat_waits(port)
                report(label, concurrency, results, (after[0] - before[0], after[1] - before[1]), wall)
        finally:
            c.stop()


if __name__ == "__main__":
    main()
