"""Weight quantization on one GPU: bf16, fp8, int8 and AWQ int4 weights of the same model (dummy weights,
Llama-3-8B shape by default), each in its own process, each against its own weight-read floor measured in
the same call (``kvrelay bench quant``).

Per variant: the model's weight bytes (quantized tensors, scales and zero points included); the floor of
a batch-1 decode step (those bytes / the device's copy bandwidth, bench/gpu_measure.py); the batch-1 step
(CUDA graphs, async scheduling) and its share of the floor; prefill tok/s of PROMPTS x LEN; with
``--throughput``, output tok/s of 128 x (32 -> 2,048). Targets (issue 27): fp8 step <= 2.25 ms and >= 1.9x
bf16, prefill >= 1.5x bf16, 128 x (32 -> 2,048) >= 16,000 tok/s; awq step >= 70% of its floor.
A variant ``awq@KERNEL`` runs AWQ with KERNEL from kernels/triton/w4_decode.py's table for its decode rows;
``fp8@unfused`` runs fp8 with its activations quantized after the norm and SiLU*mul, not by them
(kernels/triton/fp8_prologue.py); ``fp8@triton`` runs its prefill GEMMs through kernels/triton/fp8_gemm.py.
"""

import argparse
import json
import os
import subprocess
import sys
from importlib import import_module

from kvrelay.shared.config.handover import module_argv

VARIANTS = ("bf16", "fp8", "int8", "awq")


def child(args: argparse.Namespace) -> dict:
    import torch

    from kvrelay import LLM
    from kvrelay.bench.gpu_measure import (
        copy_bandwidth,
        decode_step_ms,
        generate_seconds,
        prefill_tok_s,
        random_prompts,
    )

    method, _, decode_kernel = args.variant.partition("@")
    if method == "fp8" and decode_kernel == "unfused":  # the norm and SiLU*mul write bf16, quantized after
        from kvrelay.kernels.triton import fp8_prologue

        fp8_prologue.fits = lambda x, cols: False
    elif method == "fp8" and decode_kernel == "triton":  # by module path: the package's name is the function
        import_module("kvrelay.kernels.triton.fp8_linear").PREFILL_GEMM = "triton"
    elif decode_kernel:  # "awq@w4_gemv": the W4 decode kernel of kernels/triton/w4_decode.py's table to run
        from kvrelay.kernels.triton import w4_decode

        if decode_kernel not in w4_decode.DECODE_KERNELS:
            raise SystemExit(f"unknown W4 decode kernel {decode_kernel!r}: {', '.join(w4_decode.DECODE_KERNELS)}")
        w4_decode.DECODE_KERNEL = decode_kernel
    quant = None if method == "bf16" else method
    llm = LLM(model=args.model, load_format="dummy", dtype="bfloat16", quantization=quant,
              max_model_len=args.len + 8, max_num_seqs=max(128, args.prompts),
              max_num_batched_tokens=16384, async_scheduling=True)
    weights = llm.engine.core.weight_bytes
    bandwidth = copy_bandwidth()
    out = {"variant": args.variant, "weights_gb": weights / 1e9, "floor_ms": weights / bandwidth * 1e3}
    decode_step_ms(llm, 1, 32, 10)  # warm
    out["b1_ms"] = min(decode_step_ms(llm, 1, 32, 100) for _ in range(3))
    out["of_floor"] = out["floor_ms"] / out["b1_ms"]
    vocab = llm.engine.core.vocab_size
    generate_seconds(llm, random_prompts(2, args.len, vocab, seed=100), 1)  # warm the prefill shapes
    out["prefill_tok_s"], runs = prefill_tok_s(llm, args.prompts, args.len, vocab, seed=10)  # seeds 10, 11: unused
    out["prefill_runs"] = " / ".join(f"{x:,.0f}" for x in runs)
    if args.throughput:
        short = random_prompts(128, 32, vocab, seed=2)
        out["b128_out_tok_s"] = 128 * 2048 / generate_seconds(llm, short, 2048)
    torch.cuda.synchronize()
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="dummy:llama-3-8b")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--prompts", type=int, default=32, help="prefill: this many prompts at once")
    p.add_argument("--len", type=int, default=4096, help="prefill: tokens per prompt")
    p.add_argument("--throughput", action="store_true", help="also 128 x (32 -> 2,048) output tok/s")
    p.add_argument("--variant", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.variant:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    rows = []
    for name in args.variants.split(","):
        cmd = [*module_argv("kvrelay.bench.quant_speed"), "--model", args.model, "--prompts",
               str(args.prompts), "--len", str(args.len), "--variant", name] + (["--throughput"] if args.throughput else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"{name}: failed (rc {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            continue
        rows.append(json.loads(lines[-1][len("RESULT "):]))
        print(rows[-1], flush=True)
    if not rows:
        return 1
    base = next((r for r in rows if r["variant"] == "bf16"), rows[0])
    keys = [k for k in rows[0] if k != "variant"]
    print("| variant | " + " | ".join(keys) + " | step vs bf16 | prefill vs bf16 |")
    print("| --- |" + " --- |" * (len(keys) + 2))
    for r in rows:
        cells = [f"{r[k]:.3f}" if isinstance(r.get(k), float) else str(r.get(k)) for k in keys]
        print(f"| {r['variant']} | " + " | ".join(cells)
              + f" | {base['b1_ms'] / r['b1_ms']:.2f}x | {r['prefill_tok_s'] / base['prefill_tok_s']:.2f}x |")
    return 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(p)
    sys.exit(run(p.parse_args(argv)))


if __name__ == "__main__":
    main()
