"""``kvrelay bench throughput|latency``: the offline engine against HF transformers ``generate`` in the
same process on the same weights and prompts: as one left-padded batch (plain HF batching, the bar to
beat) and, for throughput, one prompt at a time (as a user without a serving engine would run it)."""

import argparse
import random
import time

import torch

from kvrelay import LLM, SamplingParams

PAD = 0  # HF's pad id here; padded positions are masked out, so its value never matters


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF dir, .gguf, 'smollm2' (default) or dummy:<preset>")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8, help="latency: requests per batch")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--iters", type=int, default=3, help="latency: timed iterations")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--baseline", choices=["none", "hf", "hf-batch"], default="none",
                   help="hf: also time HF transformers generate on the same prompts (throughput: as one padded "
                        "batch and one prompt at a time) and print the ratios; hf-batch: the padded batch only")
    p.add_argument("--repeats", type=int, default=1,
                   help="throughput: timed runs of the engine, each followed by the padded-batch baseline")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)


def _prompts(llm: LLM, n: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = llm.engine.core.vocab_size
    return [[rng.randrange(100, vocab - 100) for _ in range(input_len)] for _ in range(n)]


def _hf_model(llm: LLM):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = llm.engine.config.model
    dtype = llm.engine.core.dtype
    device = llm.engine.config.device
    if cfg.load_format == "dummy":
        hf_cfg = AutoConfig.for_model(**llm.engine.core.hf_config)
        return AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).to(device).eval()
    return AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype).to(device).eval()


@torch.inference_mode()
def _hf_generate(model, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    """HF ``generate`` on ``prompts`` as one batch, left-padded, greedy, exactly ``output_len`` new
    tokens each (EOS is held off by min_new_tokens); returns the new tokens of each prompt."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=output_len,
                         min_new_tokens=output_len, pad_token_id=PAD)
    return out[:, width:].tolist()


def _check_lengths(who: str, outputs: list[list[int]], output_len: int) -> None:
    # a short output would inflate tok/s: both sides must make exactly the tokens they are credited with
    bad = [len(o) for o in outputs if len(o) != output_len]
    if bad:
        raise RuntimeError(f"{who} made {bad[0]} tokens for a prompt, not {output_len}")


def run_throughput(args: argparse.Namespace) -> dict:
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, device=args.device,
              max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = _prompts(llm, 2, args.input_len, args.seed - 1)  # prompts of their own: a timed one would be cached
    llm.generate([{"prompt_token_ids": warm[0]}], SamplingParams(max_tokens=2))
    hf = None
    if args.baseline in ("hf", "hf-batch"):
        hf = _hf_model(llm)
        _hf_generate(hf, warm, 2)
    new_tokens = args.num_prompts * args.output_len
    result: dict = {"repeats": []}
    # engine and padded batch alternate, so a load change on a shared machine hits both sides of a ratio
    for repeat in range(args.repeats):
        # new prompts each repeat: the prefix cache holds the last repeat's, which would skip their prefill
        prompts = _prompts(llm, args.num_prompts, args.input_len, args.seed + repeat)
        start, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        ours = [o.outputs[0].token_ids for o in outs]
        _check_lengths("kvrelay", ours, args.output_len)
        run = {"kvrelay_s": elapsed, "kvrelay_cpu_s": cpu, "kvrelay_out_tok_s": new_tokens / elapsed,
               "kvrelay_total_tok_s": (new_tokens + args.num_prompts * args.input_len) / elapsed}
        print(f"kvrelay   : {args.num_prompts} prompts x {args.input_len} in / {args.output_len} out in {elapsed:.2f} s"
              f" ({cpu:.2f} CPU s) -> {run['kvrelay_out_tok_s']:.1f} output tok/s, "
              f"{run['kvrelay_total_tok_s']:.1f} total tok/s")
        if hf is not None:
            start, cpu = time.perf_counter(), time.process_time()
            theirs = _hf_generate(hf, prompts, args.output_len)
            batch_s, cpu = time.perf_counter() - start, time.process_time() - cpu
            _check_lengths("HF generate", theirs, args.output_len)
            run["hf_batch_out_tok_s"] = new_tokens / batch_s
            run["ratio_batch"] = run["kvrelay_out_tok_s"] / run["hf_batch_out_tok_s"]
            # CPU seconds (all of this process's threads): the work each side did, which other
            # processes on a shared machine disturb far less than they disturb wall time
            run["ratio_batch_cpu"] = cpu / run["kvrelay_cpu_s"]
            run["same_as_hf"] = sum(a == b for a, b in zip(ours, theirs, strict=True))
            print(f"HF generate (padded batch of {args.num_prompts}): {batch_s:.2f} s ({cpu:.2f} CPU s) -> "
                  f"{run['hf_batch_out_tok_s']:.1f} output tok/s; ratio kvrelay / batch: {run['ratio_batch']:.2f}x "
                  f"(in CPU seconds {run['ratio_batch_cpu']:.2f}x); greedy outputs identical: "
                  f"{run['same_as_hf']}/{args.num_prompts}")
        result["repeats"].append(run)
    result.update(_median_run(result["repeats"]))
    if hf is not None and args.baseline == "hf":
        start = time.perf_counter()
        for p in prompts:  # sequential generate: what a user without a serving engine runs
            _check_lengths("HF generate", _hf_generate(hf, [p], args.output_len), args.output_len)
        seq_s = time.perf_counter() - start
        result["hf_out_tok_s"] = new_tokens / seq_s
        result["ratio"] = result["kvrelay_out_tok_s"] / result["hf_out_tok_s"]
        print(f"HF generate (sequential): {seq_s:.2f} s -> {result['hf_out_tok_s']:.1f} output tok/s")
        print(f"ratio kvrelay / HF sequential: {result['ratio']:.2f}x")
    if hf is not None:
        print(f"ratio kvrelay / HF padded batch: {result['ratio_batch']:.2f}x (median of {args.repeats})")
    return result


def _median_run(runs: list[dict]) -> dict:
    """The repeat with the median ratio against the batch (or the median engine speed without one)."""
    key = "ratio_batch" if "ratio_batch" in runs[0] else "kvrelay_out_tok_s"
    return sorted(runs, key=lambda r: r[key])[len(runs) // 2]


def run_latency(args: argparse.Namespace) -> dict:
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=max(args.batch_size, 1))
    prompts = _prompts(llm, args.batch_size, args.input_len, args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(batch, SamplingParams(max_tokens=2))
    times = []
    for _ in range(args.iters):
        start = time.perf_counter()
        llm.generate(batch, params)
        times.append(time.perf_counter() - start)
    times.sort()
    result = {"kvrelay_median_s": times[len(times) // 2]}
    print(f"kvrelay   : batch {args.batch_size}, {args.input_len} in / {args.output_len} out: median "
          f"{result['kvrelay_median_s'] * 1000:.1f} ms ({result['kvrelay_median_s'] / args.output_len * 1000:.2f} ms/token)")
    if args.baseline in ("hf", "hf-batch"):  # latency's baseline is the batch either way
        model = _hf_model(llm)
        _hf_generate(model, prompts, 2)
        hf_times = []
        for _ in range(args.iters):
            start = time.perf_counter()
            _hf_generate(model, prompts, args.output_len)
            hf_times.append(time.perf_counter() - start)
        hf_times.sort()
        result["hf_median_s"] = hf_times[len(hf_times) // 2]
        result["ratio"] = result["hf_median_s"] / result["kvrelay_median_s"]
        print(f"HF generate (batched): median {result['hf_median_s'] * 1000:.1f} ms")
        print(f"speed-up kvrelay vs HF: {result['ratio']:.2f}x")
    return result
