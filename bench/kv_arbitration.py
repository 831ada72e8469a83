"""``kvrelay bench arbitration``: two co-resident models in one process, one KV pool arbitrated by
demand (shared/engine/kv_pool.py) against a static half/half split of the same bytes, same run.

The load is skewed: most requests go to model A (long outputs), a few to B. Both engines are stepped
in turn on one thread, as a worker hosting both does. Static: each engine gets a private cache of
half the bytes. Arbitrated: both attach to one pool at their floors (one max_model_len sequence) and
grow on demand, A into whatever B is not using. Prints output tokens/s of both, their ratio, and per
model the preemptions, peak running sequences and peak owned KV blocks.
"""

import argparse
import random
import time
from dataclasses import dataclass

import torch

from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvrelay.shared.engine import EngineCore, KVPool
from kvrelay.shared.repo.model_source import resolve_model
from kvrelay.shared.wire.sampling_params import SamplingParams


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-a", default="dummy:tiny-llama", help="the busy model: HF dir, 'smollm2', dummy:<preset>")
    p.add_argument("--model-b", default="dummy:tiny-gpt2", help="the mostly idle one")
    p.add_argument("--kv-cache-memory", type=int, default=2 << 20, help="bytes of KV for both models together")
    p.add_argument("--chunk-bytes", type=int, default=None, help="pool chunk size (default: KVPool's)")
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--share-a", type=float, default=0.9, help="fraction of the requests that go to model A")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternating; the fastest counts")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads; 1 keeps tiny models' timings steady on a busy shared box")


@dataclass
class ModelRun:
    preempted: int = 0
    peak_running: int = 0
    peak_blocks: int = 0
    output_tokens: int = 0


class _Watch:
    """Engine observer: preemptions, peak running sequences and owned blocks."""

    def __init__(self, core: EngineCore, run: ModelRun):
        self.core, self.run = core, run
        core.observer = self

    def on_step(self, started, out, finished) -> None:
        r, core = self.run, self.core
        r.preempted += len(out.preempted)
        r.peak_running = max(r.peak_running, core.num_running)
        r.peak_blocks = max(r.peak_blocks, core.num_total_blocks)

    def on_removed(self, requests) -> None:
        pass


def _config(args: argparse.Namespace, model: str, kv_bytes: int | None) -> EngineConfig:
    resolved = resolve_model(model)
    return EngineConfig(
        model=ModelConfig(resolved.path, dtype=args.dtype, max_model_len=args.max_model_len,
                          load_format=resolved.load_format, seed=args.seed),
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory=kv_bytes),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens),
        device=args.device)


def _engines(args: argparse.Namespace, arbitrated: bool) -> list[EngineCore]:
    models = [args.model_a, args.model_b]
    if not arbitrated:  # each model a private cache of half the bytes: today's static split
        return [EngineCore(_config(args, m, args.kv_cache_memory // 2)) for m in models]
    first = _config(args, models[0], None)
    pool = KVPool(args.kv_cache_memory, first.device, args.chunk_bytes)
    return [EngineCore(_config(args, m, None), kv_pool=pool, kv_pool_key=f"{i}:{m}") for i, m in enumerate(models)]


def _workload(args: argparse.Namespace, cores: list[EngineCore]) -> list[tuple[int, list[int]]]:
    rng = random.Random(args.seed)
    vocab = min(c.vocab_size for c in cores)
    return [(0 if rng.random() < args.share_a else 1, [rng.randrange(3, vocab) for _ in range(args.input_len)])
            for _ in range(args.num_requests)]


def run_once(args: argparse.Namespace, arbitrated: bool) -> tuple[float, list[ModelRun]]:
    cores = _engines(args, arbitrated)
    runs = [ModelRun() for _ in cores]
    for core, r in zip(cores, runs, strict=True):
        _Watch(core, r)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i, (which, prompt) in enumerate(_workload(args, cores)):
        cores[which].add_request(cores[which].make_request(f"r{i}", prompt, params))
    start = time.perf_counter()
    while any(c.has_unfinished() for c in cores):
        for core, r in zip(cores, runs, strict=True):
            if core.has_unfinished():
                r.output_tokens += sum(len(o.new_token_ids) for o in core.step())
    return time.perf_counter() - start, runs


def run(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    best: dict[str, tuple[float, list[ModelRun]]] = {}
    for _ in range(args.repeats):
        for mode in ("static", "arbitrated"):
            elapsed, runs = run_once(args, mode == "arbitrated")
            if mode not in best or elapsed < best[mode][0]:
                best[mode] = (elapsed, runs)
    result: dict = {}
    print(f"A={args.model_a} B={args.model_b} kv={args.kv_cache_memory} bytes, {args.num_requests} requests "
          f"({args.share_a:.0%} to A), {args.input_len} in / {args.output_len} out")
    for mode, (elapsed, runs) in best.items():
        tokens = sum(r.output_tokens for r in runs)
        result[mode] = {"seconds": elapsed, "tok_s": tokens / elapsed,
                        "models": [vars(r) for r in runs]}
        per = "; ".join(f"{name}: preempted {r.preempted}, peak running {r.peak_running}, peak blocks {r.peak_blocks}"
                        for name, r in zip("AB", runs, strict=True))
        print(f"{mode:>10}: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} tok/s ({per})")
    result["ratio"] = result["arbitrated"]["tok_s"] / result["static"]["tok_s"]
    print(f"arbitrated / static throughput: {result['ratio']:.2f}x")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_args(parser)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
