"""Prefix affinity on vs off: two prefill workers, one decode worker, a gateway, and a workload of
prompt groups sharing a long prefix, sent interleaved (the first of every group, then the second, ...)
so that a group's requests are spread out in time as in real traffic. Reports the prefix-cache hit rate
(cached / prompt tokens, as the gateway's usage reports them) and the latency of one-token completions,
which is the time to first token plus the handoff.

    python -m kvrelay.bench.affinity [--model smollm2] [--groups 8] [--per-group 4] [--concurrency 4]

Each mode gets a fresh stack (fresh caches, flushed Redis): every role its own process, as in production
(kvrelay/local_cluster.py).
"""

import argparse
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from kvrelay.local_cluster import LocalCluster
from kvrelay.shared.wire.redis_conn import EmbeddedRedis, sync_client


def workload(groups: int, per_group: int, prefix_len: int, suffix_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, vocab) for _ in range(prefix_len)] for _ in range(groups)]
    return [prefixes[g] + [rng.randrange(100, vocab) for _ in range(suffix_len)]
            for _ in range(per_group) for g in range(groups)]


def run_mode(args: argparse.Namespace, affinity: bool, redis_url: str, log_dir: Path) -> dict:
    redis = sync_client(redis_url)
    redis.flushall()
    redis.close()
    c = LocalCluster(redis_url, log_dir)
    try:
        c.start_gateway(extra=[] if affinity else ["--no-prefix-affinity"])
        for name in ("p1", "p2"):
            c.start_worker("prefill", name, args.model, args.engine_args)
        c.start_worker("decode", "d1", args.model, args.engine_args)
        c.wait_ready(timeout=300)
        client = openai.OpenAI(base_url=c.base_url(), api_key="none", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        prompts = workload(args.groups, args.per_group, args.prefix_len, args.suffix_len, args.vocab, args.seed)

        def one(prompt: list[int]) -> tuple[float, int, int]:
            start = time.perf_counter()
            out = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0.0)
            return time.perf_counter() - start, out.usage.prompt_tokens, out.usage.prompt_tokens_details.cached_tokens

        one(prompts[0][::-1])  # warm-up, a prefix nobody else uses
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(one, prompts))
    finally:
        c.stop()
    lat = sorted(r[0] for r in results)
    repeats = results[args.groups:]  # every request after its group's first could hit the cache
    return {"affinity": affinity, "hit_rate": sum(r[2] for r in results) / sum(r[1] for r in results),
            "repeat_hits": sum(r[2] > 0 for r in repeats) / len(repeats),
            "mean_s": statistics.mean(lat), "p50_s": lat[len(lat) // 2], "p90_s": lat[int(len(lat) * 0.9)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=256)  # the gateway keys on the first 256 tokens
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("engine_args", nargs="*", help="after --: engine flags for every worker")
    args = p.parse_args()
    with EmbeddedRedis() as redis_url, tempfile.TemporaryDirectory() as logs:
        for affinity in (False, True):
            r = run_mode(args, affinity, redis_url, Path(logs))
            print(f"affinity={'on ' if r['affinity'] else 'off'}  prefix-cache hit rate {r['hit_rate']:.1%}  "
                  f"repeats that hit {r['repeat_hits']:.0%}  1-token latency mean {r['mean_s'] * 1000:.0f} ms  "
                  f"p50 {r['p50_s'] * 1000:.0f} ms  p90 {r['p90_s'] * 1000:.0f} ms", flush=True)


if __name__ == "__main__":
    main()
