"""``kvrelay bench gpu``: the engine on one GPU (Llama-3-8B shape, bf16, dummy weights) against the
floors measured in the same run and HF transformers ``generate`` on the same config.

  1. HBM copy bandwidth -> batch-1 decode floor = weight bytes / bandwidth; our batch-1 ms/step
     (CUDA graphs, and eager on the same loaded model); HF's.
  2. decode throughput: N concurrent requests, short prompts, long outputs (ignore_eos): output tok/s
     against a floor of weights + KV bytes per step over the bandwidth; HF's at the same batch.
  3. prefill: P prompts x L tokens: tok/s against the FLOPs per token over the measured matmul rate.
  4. fused vs unfused: decode step ms with KVRELAY_KERNELS=reference vs triton, each in a child
     process (the variable is read when ``kernels`` is imported), graphs and eager.

Run on a CUDA machine from the repository root: ``PYTHONUNBUFFERED=1 python -m bench.gpu`` (or
``kvrelay bench gpu``); ``--json PATH`` also writes every number.
"""

import argparse
import gc
import json
import os
import subprocess

import torch

from kvrelay.bench import gpu_measure as m
from kvrelay.shared.config.handover import module_argv
from kvrelay.shared.engine.profile import decode_graphs, model_shape, set_async_scheduling, set_eager
from kvrelay.shared.worker.gc_freeze import freeze_long_lived

CHILD_TAG = "CHILD_RESULT "
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="dummy:llama-3-8b")
    p.add_argument("--decode-steps", type=int, default=200, help="timed batch-1 decode steps")
    p.add_argument("--batch", type=int, default=128, help="throughput: concurrent requests")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=2048)
    p.add_argument("--prefill-prompts", type=int, default=32)
    p.add_argument("--prefill-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the step budget (default: the offline engine's, vLLM's LLM-class default for this GPU)")
    p.add_argument("--variant-batches", default="1,64", help="fused-vs-unfused decode batches")
    p.add_argument("--async-scheduling", action="store_true",
                   help="the engine of every row schedules asynchronously (the batch-N on/off rows compare both)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-variants", action="store_true")
    p.add_argument("--json", default=None, help="write all results here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def _engine(args: argparse.Namespace, **kw) -> "m.LLM":
    llm = m.LLM(model=args.model, load_format="dummy", **kw)
    freeze_long_lived()  # as a worker process does once its model is loaded (shared/worker/gc_freeze.py)
    return llm


def run_child(args: argparse.Namespace) -> dict:
    """One kernel variant (KVRELAY_KERNELS from the parent): decode ms/step, graphs and eager."""
    batches = [int(b) for b in args.variant_batches.split(",")]
    llm = _engine(args, max_model_len=2048, num_gpu_blocks=4096, max_num_seqs=max(batches))
    core = llm.engine.core
    out = {"kernels": os.environ.get("KVRELAY_KERNELS", "triton"), "graphs": decode_graphs(core) is not None}
    for batch in batches:
        for eager in (False, True):
            if not eager and decode_graphs(core) is None:
                out[f"graphs_b{batch}"] = None  # could not be captured: see the warning above
                continue
            set_eager(core, eager)
            out[f"{'eager' if eager else 'graphs'}_b{batch}"] = m.decode_step_ms(llm, batch, 32, steps=24)
    set_eager(core, False)
    print(CHILD_TAG + json.dumps(out), flush=True)
    return out


def _variants(args: argparse.Namespace) -> list[dict]:
    results = []
    for kernels in ("triton", "reference"):
        env = dict(os.environ, KVRELAY_KERNELS=kernels, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [*module_argv("kvrelay.bench.gpu"), "--child", "--model", args.model,
               "--variant-batches", args.variant_batches]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(CHILD_TAG)]
        if proc.returncode or not lines:
            print(f"variant {kernels} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
            continue
        results.append(json.loads(lines[-1][len(CHILD_TAG):]))
        warned = [ln for ln in proc.stderr.splitlines() if "decode runs eagerly" in ln]
        if warned:
            print(f"variant {kernels}: {warned[-1].split(': ', 1)[-1][:200]}")
    return results


def _hf(args: argparse.Namespace, hf_config: dict) -> dict:
    model = m.hf_model(hf_config)
    res = {
        "hf_b1_ms": m.hf_decode_step_ms(model, 1, args.input_len),
        "hf_batch_ms": m.hf_decode_step_ms(model, args.batch, args.input_len),
        "hf_prefill_tok_s": m.hf_prefill_tok_s(model, min(8, args.prefill_prompts), args.prefill_len),
    }
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return res


def _throughput_floor(args, weight_bytes: float, kv_bytes_per_token: float, bw: float, flops_rate: float,
                      flops_per_token: float) -> float:
    """Output tok/s if every decode step took max(bytes / bandwidth, FLOPs / matmul rate): weights once
    per step plus every sequence's whole KV, growing by one token a step."""
    total = 0.0
    for s in range(args.output_len):
        nbytes = weight_bytes + args.batch * (args.input_len + s) * kv_bytes_per_token
        total += max(nbytes / bw, args.batch * flops_per_token / flops_rate)
    return args.batch * args.output_len / total


def run(args: argparse.Namespace) -> dict:
    if args.child:
        return run_child(args)
    if not torch.cuda.is_available():
        raise SystemExit("kvrelay bench gpu needs a CUDA device")
    r: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    r["copy_bw"] = m.copy_bandwidth()
    r["matmul_flops"] = m.matmul_flops()
    print(f"{r['gpu']}: copy {r['copy_bw'] / 1e9:,.0f} GB/s (read + write), bf16 matmul {r['matmul_flops'] / 1e12:.0f} TFLOP/s")
    torch.cuda.empty_cache()  # the engine sizes its KV cache from what is free
    r["variants"] = [] if args.skip_variants else _variants(args)

    llm = _engine(args, max_num_seqs=args.batch, max_num_batched_tokens=args.max_num_batched_tokens,
                  async_scheduling=args.async_scheduling)
    core = llm.engine.core
    hf_config = dict(core.hf_config)
    shape = model_shape(core)
    r["weight_bytes"] = core.weight_bytes
    r["weight_bytes_read"] = r["weight_bytes"] - shape["embed_bytes"]  # a step reads B rows
    kv_per_token = core.block_bytes / core.block_size
    non_embed_params = r["weight_bytes_read"] / core.dtype.itemsize
    r["floor_b1_ms"] = r["weight_bytes"] / r["copy_bw"] * 1e3

    m.generate_seconds(llm, m.random_prompts(2, args.input_len, core.vocab_size, 9), 8)  # warm-up
    r["b1_ms"] = m.decode_step_ms(llm, 1, args.input_len, args.decode_steps)
    r["b1_replay_ms"] = m.replay_ms(llm)
    r["b1_replay_long_ms"] = m.replay_ms(llm, core.max_model_len)  # the graph captured for any length
    set_eager(core, True)
    r["b1_eager_ms"] = m.decode_step_ms(llm, 1, args.input_len, 30)
    set_eager(core, False)
    print(f"batch-1 decode: {r['b1_ms']:.2f} ms/step (graph replay alone: {r['b1_replay_ms']} ms; with the "
          f"any-length graph {r['b1_replay_long_ms']} ms), eager {r['b1_eager_ms']:.2f}; floor {r['floor_b1_ms']:.2f}")
    # host vs GPU at the throughput batch, at a mid-run context (1k tokens), and at batch 1
    r["b1_breakdown"] = m.decode_step_breakdown(llm, 1, args.input_len, 50)
    r["bN_breakdown"] = m.decode_step_breakdown(llm, args.batch, 1024, 20)
    r["bN_ms"] = r["bN_breakdown"]["wall_ms"]
    r["bN_async"] = m.async_decode_step_ms(llm, args.batch, 1024, 20)
    r["b1_async"] = m.async_decode_step_ms(llm, 1, args.input_len, 100)
    print("async scheduling, batch 1", ", ".join(f"{k} {v:.3f}" for k, v in r["b1_async"].items()))
    print("async scheduling, batch", args.batch, ", ".join(f"{k} {v:.3f}" for k, v in r["bN_async"].items()))
    for name in ("b1_breakdown", "bN_breakdown"):
        print(name, ", ".join(f"{k} {v:.3f}" for k, v in r[name].items()))
    ctx = 1024 + 5 + 20  # prompt + warm-up + half the timed steps, roughly
    r["floor_bN_ms"] = (r["weight_bytes"] + args.batch * ctx * kv_per_token) / r["copy_bw"] * 1e3

    prompts = m.random_prompts(args.batch, args.input_len, core.vocab_size, 3)
    secs = m.generate_seconds(llm, prompts, args.output_len)
    r["tput_tok_s"] = args.batch * args.output_len / secs
    flops_tok = 2 * non_embed_params
    r["tput_floor_tok_s"] = _throughput_floor(args, r["weight_bytes"], kv_per_token, r["copy_bw"],
                                              r["matmul_flops"], flops_tok)
    print(f"decode throughput: {r['tput_tok_s']:,.0f} output tok/s ({secs:.1f} s)")
    if not args.async_scheduling:  # issue #22 item 2's target is this run with the host off the critical path
        set_async_scheduling(core, True)
        # other prompts of the same shape, so no prefix cached by the run above shortens this one
        secs = m.generate_seconds(llm, m.random_prompts(args.batch, args.input_len, core.vocab_size, 13), args.output_len)
        set_async_scheduling(core, False)
        r["tput_async_tok_s"] = args.batch * args.output_len / secs
        print(f"decode throughput, async scheduling: {r['tput_async_tok_s']:,.0f} output tok/s ({secs:.1f} s)")

    m.generate_seconds(llm, m.random_prompts(1, args.prefill_len, core.vocab_size, 5), 1)  # warm-up (seed 5: its own)
    r["prefill_tok_s"], runs = m.prefill_tok_s(llm, args.prefill_prompts, args.prefill_len, core.vocab_size, 40)
    layers, heads, head_dim = shape["num_layers"], shape["num_heads"], shape["head_dim"]
    attn_flops_tok = 4 * (args.prefill_len / 2) * heads * head_dim * layers  # QK^T and PV, causal average
    r["prefill_floor_tok_s"] = r["matmul_flops"] / (flops_tok + attn_flops_tok)
    r["step_tokens"] = core.max_num_batched_tokens
    print(f"prefill: {r['prefill_tok_s']:,.0f} tok/s (runs: {', '.join(f'{x:,.0f}' for x in runs)}; steps of up to "
          f"{r['step_tokens']} tokens)")
    ours, paged, sdpa = m.prefill_attention(2, args.prefill_len, heads, shape["num_kv_heads"], head_dim)
    attn_flops = 2 * 4 * (args.prefill_len ** 2 / 2) * heads * head_dim  # 2 prompts, causal, one layer
    r["prefill_attn_ms"], r["paged_prefill_attn_ms"], r["sdpa_attn_ms"] = ours, paged, sdpa
    print(f"prefill attention, 2 x {args.prefill_len} tokens, one layer: ours {ours:.3f} ms "
          f"({attn_flops / ours / 1e9:.0f} TFLOP/s; the paged Triton kernel alone {paged:.3f} ms), "
          f"torch SDPA {sdpa:.3f} ms ({attn_flops / sdpa / 1e9:.0f} TFLOP/s)")
    del llm, core
    gc.collect()
    torch.cuda.empty_cache()

    if not args.skip_hf:
        try:
            r.update(_hf(args, hf_config))
        except Exception as e:  # keep our own numbers when the baseline breaks (a transformers API change)
            print(f"HF baseline failed: {type(e).__name__}: {e}")
    _print_table(args, r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return r


def _print_table(args: argparse.Namespace, r: dict) -> None:
    def row(name, ours, unit, floor=None, pct=None, hf=None, ratio=None):
        f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        print(f"| {name} | {f(ours, ',.2f')} {unit} | {f(floor, ',.2f')} | {f(pct, '.1f')}% | {f(hf, ',.2f')} | {f(ratio, '.1f')}x |")

    print(f"\nGPU: {r['gpu']}, torch {r['torch']}; copy {r['copy_bw'] / 1e9:,.0f} GB/s; "
          f"bf16 matmul {r['matmul_flops'] / 1e12:.0f} TFLOP/s; weights {r['weight_bytes'] / 1e9:.2f} GB")
    print("| measurement | kvrelay | floor | % of floor | HF transformers | kvrelay vs HF |")
    print("| --- | --- | --- | --- | --- | --- |")
    hf_b1, hf_b = r.get("hf_b1_ms"), r.get("hf_batch_ms")
    fl = r["floor_b1_ms"]
    row("batch-1 decode, CUDA graphs (ms/step)", r["b1_ms"], "ms", fl, 100 * fl / r["b1_ms"], hf_b1,
        hf_b1 and hf_b1 / r["b1_ms"])
    # GPU time of a real step: CUDA events around its input copy + graph replay (back-to-back replays
    # of one step are no measure at batch 128: they ran faster than its bytes allow)
    g1 = r["b1_breakdown"].get("replay_gpu_ms")
    if g1:
        row("batch-1 decode, GPU time of the step (ms)", g1, "ms", fl, 100 * fl / g1)
    if r["b1_replay_ms"] and r["b1_replay_long_ms"]:
        print(f"| batch-1 graph for contexts <= 512 vs the any-length graph (bare replays) | {r['b1_replay_ms']:.2f} ms "
              f"| - | - | {r['b1_replay_long_ms']:.2f} | {r['b1_replay_long_ms'] / r['b1_replay_ms']:.3f}x |")
    row("batch-1 decode, eager (ms/step)", r["b1_eager_ms"], "ms", fl, 100 * fl / r["b1_eager_ms"], hf_b1,
        hf_b1 and hf_b1 / r["b1_eager_ms"])
    hf_tput = hf_b and args.batch / hf_b * 1e3
    row(f"decode {args.batch} x {args.input_len}->{args.output_len} (out tok/s)", r["tput_tok_s"], "tok/s",
        r["tput_floor_tok_s"], 100 * r["tput_tok_s"] / r["tput_floor_tok_s"], hf_tput, hf_tput and r["tput_tok_s"] / hf_tput)
    if "tput_async_tok_s" in r:
        row(f"decode {args.batch} x {args.input_len}->{args.output_len}, async scheduling (out tok/s)",
            r["tput_async_tok_s"], "tok/s", r["tput_floor_tok_s"], 100 * r["tput_async_tok_s"] / r["tput_floor_tok_s"])
    fN = r["floor_bN_ms"]
    row(f"batch-{args.batch} decode step at 1k context (ms)", r["bN_ms"], "ms", fN, 100 * fN / r["bN_ms"])
    gN = r["bN_breakdown"].get("replay_gpu_ms")
    if gN:
        row(f"batch-{args.batch} decode at 1k context, GPU time of the step (ms)", gN, "ms", fN, 100 * fN / gN)
    # async scheduling's target: the step's wall time within 5% of its GPU time (ratio column: wall / GPU)
    a = r["bN_async"]
    for mode in ("sync", "async"):
        print(f"| batch-{args.batch} decode step at 1k context, async scheduling {'on' if mode == 'async' else 'off'}"
              f" (wall ms vs GPU ms) | {a[mode + '_ms']:.2f} ms | - | - | GPU {gN or 0:.2f} | "
              f"{(a[mode + '_ms'] / gN) if gN else 0:.3f}x |")
    hf_pf = r.get("hf_prefill_tok_s")
    row(f"prefill {args.prefill_prompts} x {args.prefill_len} (tok/s)", r["prefill_tok_s"], "tok/s",
        r["prefill_floor_tok_s"], 100 * r["prefill_tok_s"] / r["prefill_floor_tok_s"], hf_pf, hf_pf and r["prefill_tok_s"] / hf_pf)
    print(f"| prefill attention, 2 x {args.prefill_len}, one layer (ms) | {r['prefill_attn_ms']:.3f} ms | - | - | "
          f"torch SDPA {r['sdpa_attn_ms']:.3f} | {r['sdpa_attn_ms'] / r['prefill_attn_ms']:.2f}x |")
    print(f"| the same through the paged Triton kernel (a prompt with a cached prefix) (ms) | "
          f"{r['paged_prefill_attn_ms']:.3f} ms | - | - | torch SDPA {r['sdpa_attn_ms']:.3f} | "
          f"{r['sdpa_attn_ms'] / r['paged_prefill_attn_ms']:.2f}x |")
    if r["variants"]:
        print("\n| decode ms/step (max_model_len 2048) | " + " | ".join(
            k for k in r["variants"][0] if k not in ("kernels", "graphs")) + " |")
        print("| --- |" + " --- |" * (len(r["variants"][0]) - 2))
        for v in r["variants"]:
            cells = [("-" if x is None else f"{x:.2f}") for k, x in v.items() if k not in ("kernels", "graphs")]
            print(f"| {v['kernels']} | " + " | ".join(cells) + " |")
        by = {v["kernels"]: v for v in r["variants"]}
        if "triton" in by and "reference" in by:
            for key, x in by["triton"].items():
                ref = by["reference"].get(key)
                if key.startswith(("graphs_", "eager_")) and x and ref:
                    print(f"fused (triton) vs unfused (reference), {key}: {ref / x:.2f}x")
            t = by["triton"]
            for b in args.variant_batches.split(","):
                if t.get(f"graphs_b{b}") and t.get(f"eager_b{b}"):
                    print(f"CUDA graphs vs eager (triton), batch {b}: {t[f'eager_b{b}'] / t[f'graphs_b{b}']:.2f}x")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
