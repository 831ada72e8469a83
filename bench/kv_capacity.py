"""KV capacity with ``--kv-cache-dtype fp8`` against the model's dtype, in one process, from the same KV
memory (``kvrelay bench kv``; on the H200: ``kvrelay bench kv`` with its defaults, Llama-3-8B shape,
dummy weights).

Per KV dtype: blocks from ``--kv-memory-gb`` of KV, bytes per token, the largest batch whose sequences all
reach ``--context`` tokens at once (blocks // blocks per sequence, capped by ``--max-num-seqs``), and the
decode throughput at that batch: the mean engine step with every sequence decoding near the full context
(CUDA graphs), as output tok/s. The engines run one after the other and the first is freed before the
second loads, so each has the device to itself. Target (issue 27): the largest batch doubles.
"""

import argparse
import gc
import json
import math
import sys

VARIANTS = ("auto", "fp8")


def measure(args: argparse.Namespace, kv_dtype: str) -> dict:
    import torch

    from kvrelay import LLM
    from kvrelay.bench.gpu_measure import decode_step_ms

    llm = LLM(model=args.model, load_format="dummy", dtype=args.dtype, kv_cache_dtype=kv_dtype,
              kv_cache_memory=int(args.kv_memory_gb * 2**30), max_model_len=args.context,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, device=args.device)
    core = llm.engine.core
    per_seq = math.ceil(args.context / core.block_size)
    batch = min(args.max_num_seqs, core.num_total_blocks // per_seq)
    out = {"kv_cache_dtype": kv_dtype, "stored_as": str(core.kv_dtype).removeprefix("torch."),
           "blocks": core.num_total_blocks, "kv_bytes_per_token": core.block_bytes // core.block_size,
           "largest_batch": batch}
    if batch and not args.no_decode:
        steps, warm = args.steps, 5
        input_len = args.context - steps - warm - 8  # every sequence ends the timed steps near the context
        step_ms = decode_step_ms(llm, batch, input_len, steps, warm=warm)
        out.update(step_ms=step_ms, decode_tok_s=batch / step_ms * 1e3)
    del llm, core
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="dummy:llama-3-8b")
    p.add_argument("--dtype", default="bfloat16", help="weights and the 'auto' KV cache")
    p.add_argument("--context", type=int, default=8192, help="tokens each sequence of the batch reaches")
    p.add_argument("--kv-memory-gb", type=float, default=48.0, help="GiB of KV cache, the same for each dtype")
    p.add_argument("--max-num-seqs", type=int, default=512, help="cap on the batch (and its CUDA graphs)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--steps", type=int, default=50, help="timed decode steps")
    p.add_argument("--device", default="auto")
    p.add_argument("--no-decode", action="store_true", help="capacity only, no throughput")


def run(args: argparse.Namespace) -> int:
    rows = [measure(args, kv_dtype) for kv_dtype in VARIANTS]
    for r in rows:
        print("RESULT " + json.dumps(r), flush=True)
    base, fp8 = rows
    keys = [k for k in base if k != "kv_cache_dtype"]
    print(f"\n{args.model}, {args.kv_memory_gb:g} GiB of KV, {args.context}-token context")
    print("| --kv-cache-dtype | " + " | ".join(keys) + " |")
    print("| --- |" + " --- |" * len(keys))
    for r in rows:
        print(f"| {r['kv_cache_dtype']} | " + " | ".join(
            f"{r[k]:.2f}" if isinstance(r.get(k), float) else str(r.get(k, "-")) for k in keys) + " |")
    if base["largest_batch"]:
        ratio = fp8["largest_batch"] / base["largest_batch"]
        print(f"largest batch fp8 / {base['stored_as']}: {ratio:.2f}x (target 2x)")
        if "decode_tok_s" in base and "decode_tok_s" in fp8:
            print(f"decode tok/s at the largest batch, fp8 / {base['stored_as']}: "
                  f"{fp8['decode_tok_s'] / base['decode_tok_s']:.2f}x")
    return 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(p)
    sys.exit(run(p.parse_args(argv)))


if __name__ == "__main__":
    main()
