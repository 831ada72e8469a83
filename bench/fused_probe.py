"""Decode steps with rotary + KV write inside the decode attention kernel ("rope") and apart ("base"), each
variant in its own process (graphs are captured at load).

    python -m kvrelay.bench.fused_probe [--model dummy:llama-3-8b] [--variants base,rope]

Prints, per variant, batch-1 and batch-N engine step ms (async scheduling on), the bare graph replay at
batch 1, and the ratio to the first variant.
"""

import argparse
import json
import os
import subprocess

from kvrelay.shared.config.handover import module_argv

VARIANTS = {"base": False, "rope": True}


def child(args: argparse.Namespace) -> dict:
    from kvrelay import LLM
    from kvrelay.bench.gpu_measure import decode_step_ms, replay_ms
    from kvrelay.kernels import registry

    if not VARIANTS[args.variant]:
        registry._cuda_impls.pop("rotary_attention", None)  # the model then rotates and attends in turn
    llm = LLM(model=args.model, load_format="dummy", max_model_len=4096, max_num_seqs=args.batch,
              max_num_batched_tokens=8192, async_scheduling=True)
    out = {"variant": args.variant}
    decode_step_ms(llm, 1, 32, 10)  # warm
    out["b1_ms"] = min(decode_step_ms(llm, 1, 32, 100) for _ in range(3))
    out["b1_replay_ms"] = replay_ms(llm)
    out["b1_long_ms"] = min(decode_step_ms(llm, 1, 2000, 50) for _ in range(2))
    out["b1_long_replay_ms"] = replay_ms(llm)
    out[f"b{args.batch}_ms"] = min(decode_step_ms(llm, args.batch, 1024, 20) for _ in range(2))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="dummy:llama-3-8b")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.variant:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    rows = []
    for name in args.variants.split(","):
        cmd = [*module_argv("kvrelay.bench.fused_probe"), "--model", args.model, "--batch", str(args.batch),
               "--variant", name]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"{name}: failed (rc {proc.returncode})\n{proc.stderr[-3000:]}")
            continue
        rows.append(json.loads(lines[-1][len("RESULT "):]))
        print(rows[-1], flush=True)
    if not rows:
        return
    base = rows[0]
    keys = [k for k in base if k != "variant"]
    print("| variant | " + " | ".join(keys) + " |")
    print("| --- |" + " --- |" * len(keys))
    for r in rows:
        cells = [f"{r[k]:.3f} ({r[k] / base[k]:.3f}x)" if r.get(k) and base.get(k) else str(r.get(k)) for k in keys]
        print(f"| {r['variant']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
