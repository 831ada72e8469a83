"""``kvrelay bench structured``: decode throughput of the engine at batch B (default 64) with and without a
10-field JSON-schema constraint on every request, same prompts, same process, alternating runs.

What is timed: full-batch decode steps (every request of the batch had its first token before the step, and
every one got a token in it), so the two sides compare the same work per step, and a constrained request
that completes its document early (ending the batch's full steps) does not bias the ratio. Each side's
tok/s is the tokens of those steps over their wall time; the grammar's share of a step (mask filled on the
host while the device computes the forward, applied in the sampler) is what the ratio shows.

A dummy model (``--model dummy:<preset> --load-format dummy``) compiles its grammar against a real
tokenizer (``--tokenizer``, default SmolLM2's): token ids past that tokenizer's vocabulary never pass the
mask, as with a checkpoint's padded embedding rows.
"""

import argparse
import json
import random
import statistics
import time

from kvrelay import LLM, SamplingParams
from kvrelay.bench.grammar_backends import SCHEMA10
from kvrelay.shared.repo.model_source import resolve_model
from kvrelay.shared.wire.structured_outputs import StructuredOutputs


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="dummy:smollm2-135m", help="HF dir, .gguf, 'smollm2' or dummy:<preset>")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's; SmolLM2's "
                                                      "for a dummy model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each side, alternating")
    p.add_argument("--async-scheduling", action="store_true")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)


def _decode(llm: LLM, tag: str, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Run the batch through the engine core; time its full-batch decode steps."""
    core = llm.engine.core
    eos = llm.engine.eos_ids[0] if llm.engine.eos_ids else None
    for i, p in enumerate(prompts):
        core.add_request(core.make_request(f"{tag}-{i}", p, params, eos))
    batch = len(prompts)
    started: set[str] = set()
    full_tokens, full_s, full_cpu, total, stopped = 0, 0.0, 0.0, 0, 0
    while core.has_unfinished():
        ready = len(started) == batch
        t0, c0 = time.perf_counter(), time.process_time()
        outs = core.step()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        made = sum(len(o.new_token_ids) for o in outs)
        total += made
        stopped += sum(o.finish_reason == "stop" for o in outs)
        started.update(o.request_id for o in outs if o.new_token_ids)
        if ready and made == batch:
            full_tokens += made
            full_s += dt
            full_cpu += dc
    return {"tok_s": full_tokens / full_s if full_s else 0.0, "full_steps": full_tokens // batch,
            "tok_cpu_s": full_tokens / full_cpu if full_cpu else 0.0, "tokens": total, "stopped": stopped}


def run(args: argparse.Namespace) -> dict:
    tokenizer = args.tokenizer
    dummy = args.load_format == "dummy" or (args.model or "").startswith("dummy:")
    if tokenizer is None and dummy:
        tokenizer = resolve_model("smollm2").path
    llm = LLM(model=args.model, load_format=args.load_format, tokenizer=tokenizer, dtype=args.dtype,
              max_num_seqs=args.batch, device=args.device, seed=args.seed, enforce_eager=args.enforce_eager,
              async_scheduling=args.async_scheduling,
              enable_prefix_caching=False)  # both runs time the same prompts: each computes them
    vocab = llm.engine.core.vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, min(vocab, 32000) - 1) for _ in range(args.input_len)] for _ in range(args.batch)]
    so = StructuredOutputs(json=json.dumps(SCHEMA10))
    plain = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(temperature=1.0, max_tokens=args.output_len, structured_outputs=so)
    fill_s: list[float] = []  # host seconds of each step's mask fill (overlapped with the forward on CUDA)
    bitmask = llm.engine.core.structured.bitmask

    def timed_bitmask(reqs):
        t0 = time.perf_counter()
        try:
            return bitmask(reqs)
        finally:
            fill_s.append(time.perf_counter() - t0)

    llm.engine.core.structured.bitmask = timed_bitmask
    # warm-up: graphs, kernels, and the grammar's compile (the tokenizer's vocabulary, the first time)
    _decode(llm, "warm-plain", prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))
    _decode(llm, "warm-json", prompts[:2], SamplingParams(max_tokens=4, structured_outputs=so))
    runs = []
    for r in range(args.repeats):
        base = _decode(llm, f"plain{r}", prompts, plain)
        fill_s.clear()
        json_run = _decode(llm, f"json{r}", prompts, constrained)
        json_run["mask_fill_us"] = 1e6 * statistics.median(fill_s) if fill_s else 0.0
        ratio = json_run["tok_s"] / base["tok_s"] if base["tok_s"] else 0.0
        # per CPU second of this process: what other processes on a shared machine disturb far less
        cpu_ratio = json_run["tok_cpu_s"] / base["tok_cpu_s"] if base["tok_cpu_s"] else 0.0
        runs.append({"unconstrained": base, "json_schema": json_run, "ratio": ratio, "cpu_ratio": cpu_ratio})
        print(f"run {r}: unconstrained {base['tok_s']:.0f} tok/s ({base['full_steps']} full steps) | "
              f"json_schema {json_run['tok_s']:.0f} tok/s ({json_run['full_steps']} full steps, "
              f"{json_run['stopped']}/{args.batch} documents completed; mask fill {json_run['mask_fill_us']:.0f} us "
              f"a step, median) | ratio {ratio:.3f} (per CPU second {cpu_ratio:.3f})")
    median = statistics.median(r["ratio"] for r in runs)
    best = sorted(runs, key=lambda r: r["ratio"])[len(runs) // 2]
    print(f"{args.model} batch {args.batch} on {llm.engine.config.device}: unconstrained "
          f"{best['unconstrained']['tok_s']:.0f} tok/s, json_schema (10 fields) {best['json_schema']['tok_s']:.0f} "
          f"tok/s, ratio {median:.3f} (median of {args.repeats}; cost {100 * (1 - median):.1f}%); per CPU "
          f"second {statistics.median(r['cpu_ratio'] for r in runs):.3f}")
    return {"runs": runs, "ratio": median}
