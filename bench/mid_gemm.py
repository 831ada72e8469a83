"""cuBLAS (F.linear) against every named config of kernels/triton/mid_linear.py at 32-256 rows and the
Llama-3-8B projection shapes (issue #22: a batch-128 decode step's GEMMs read their weights below 85% of
the copy bandwidth).

    PYTHONUNBUFFERED=1 python -m kvrelay.bench.mid_gemm [--quick] [--json PATH] [--m 128] [--configs a,b]

Timing: per (shape, rows, implementation) one CUDA graph calls the op once per weight set, rotating through
enough distinct weights (>= 512 MiB, ~10x the L2) that each call reads its weight from HBM, as a decode
step's layers do; per-call time = median replay / sets. GB/s counts the weight bytes only (x and y are
under 2% of them at 256 rows but the LM head's y); "% copy" divides that by the device-to-device copy
bandwidth (read + write bytes/s) measured in the same process. "err" is max |y - fp32 product| / max
|fp32 product| on the first weight set, cuBLAS's beside for scale. ``--smoke`` runs tiny shapes on CPU
through the Triton interpreter to check the script itself.
"""

import argparse
import json
import os
import statistics
import time

ARGS = argparse.ArgumentParser()
ARGS.add_argument("--smoke", action="store_true")
ARGS.add_argument("--quick", action="store_true", help="only mid_linear.QUICK's configs")
ARGS.add_argument("--json", default=None, metavar="PATH")
ARGS.add_argument("--m", default=None, help="row counts, e.g. 128 or 32,64 (default 32,64,128,256)")
ARGS.add_argument("--configs", default=None, help="comma-separated config names (default: all)")
OPTS = ARGS.parse_args()
if OPTS.smoke:  # before triton's first import: it decides interpreted or compiled then
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kvrelay.bench.gpu_measure import call_seconds  # noqa: E402
from kvrelay.kernels.triton import mid_linear as ml  # noqa: E402

DEV = "cpu" if OPTS.smoke else "cuda"
DTYPE = torch.bfloat16
# (name, N, K), nn.Linear layout [N, K]
SHAPES = [("gate_up", 28672, 4096), ("down", 4096, 14336), ("qkv", 6144, 4096), ("o", 4096, 4096),
          ("lm_head", 128256, 4096)] if DEV == "cuda" else [("a", 96, 256), ("b", 40, 200)]
ROWS = [32, 64, 128, 256] if DEV == "cuda" else [5, 33]
ROTATE_BYTES = 512 << 20 if DEV == "cuda" else 1 << 16
MAX_SETS = 16
LAYERS = 32  # Llama-3-8B: per-step sum of the four layer GEMMs x 32, plus the LM head once


def seconds_per_call(calls: list, reps: int = 15) -> float:
    return call_seconds(calls, DEV == "cuda", reps)


def copy_bandwidth() -> float:
    """Read + written bytes per second of a 1 GiB device copy (a small CPU copy in smoke mode)."""
    if DEV == "cuda":
        from kvrelay.bench.gpu_measure import copy_bandwidth as measured

        return measured()
    src = torch.randn(1 << 16)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / seconds_per_call([lambda: dst.copy_(src)])


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def bench_shape(name: str, n: int, k: int, configs: dict, copy_bw: float, rows_list: list[int]) -> list[dict]:
    w_bytes = n * k * DTYPE.itemsize
    sets = max(1, min(MAX_SETS, ROTATE_BYTES // w_bytes))
    gen = torch.Generator(device=DEV).manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen, device=DEV, dtype=DTYPE) * k**-0.5) for _ in range(sets)]
    rows_out = []
    for m in rows_list:
        x = torch.randn(m, k, generator=gen, device=DEV, dtype=DTYPE)
        ref = F.linear(x.float(), weights[0].float())
        impls = {"cublas": lambda w, x=x: F.linear(x, w)}
        impls |= {c: (lambda w, x=x, c=c: ml.mid_linear(x, w, config=configs[c])) for c in configs}
        base = None
        for impl, fn in impls.items():
            try:
                err = rel_err(fn(weights[0]), ref)
                t = seconds_per_call([lambda w=w, fn=fn: fn(w) for w in weights])
            except Exception as e:  # a config the device cannot build (shared memory, registers): say so, go on
                print(f"{name:>8} {m:>4} {impl:<22} failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
                continue
            base = t if impl == "cublas" else base
            row = dict(shape=name, n=n, k=k, m=m, impl=impl, us=t * 1e6, gbps=w_bytes / t / 1e9,
                       pct_copy=100 * w_bytes / t / copy_bw, vs_cublas=base / t if base else None, err=err)
            rows_out.append(row)
            vs = f"{row['vs_cublas']:.2f}x" if row["vs_cublas"] else "-"
            print(f"{name:>8} {m:>4} {impl:<22} {row['us']:>9.1f} {row['gbps']:>7.0f} {row['pct_copy']:>6.1f}% "
                  f"{vs:>7} {err:>9.2e}")
    del weights
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return rows_out


def summarize(results: list[dict]) -> dict:
    """Best config per (shape, rows), and per row count the modelled step: 32 x (layer GEMMs) + LM head."""
    best: dict = {}
    for r in results:
        if r["impl"] != "cublas":
            key = (r["shape"], r["m"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    cublas = {(r["shape"], r["m"]): r for r in results if r["impl"] == "cublas"}
    print(f"\nbest config per shape  {'shape':>8} {'m':>4} {'config':<22} {'us':>9} {'% copy':>7} {'vs cuBLAS':>9}")
    for (shape, m), r in best.items():
        print(f"{'':22} {shape:>8} {m:>4} {r['impl']:<22} {r['us']:>9.1f} {r['pct_copy']:>6.1f}% {r['vs_cublas'] or 0:>8.2f}x")
    step = {}
    for m in sorted({m for _, m in best}):
        def total(table, m=m):
            return sum((1 if s == "lm_head" else LAYERS) * table[(s, m)]["us"] for s, *_ in SHAPES if (s, m) in table)
        step[m] = dict(cublas_us=total(cublas), best_us=total(best))
        print(f"step GEMMs at {m} rows (x{LAYERS} layers + LM head): cuBLAS {step[m]['cublas_us']:.0f} us, "
              f"best configs {step[m]['best_us']:.0f} us")
    return dict(best={f"{s}@{m}": r["impl"] for (s, m), r in best.items()}, step=step)


def main() -> None:
    if DEV == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs CUDA (or --smoke)")
    names = OPTS.configs.split(",") if OPTS.configs else list(ml.QUICK if OPTS.quick else ml.CONFIGS)
    unknown = [c for c in names if c not in ml.CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; known: {sorted(ml.CONFIGS)}")
    configs = {c: ml.CONFIGS[c] for c in names}
    rows_list = [int(v) for v in OPTS.m.split(",")] if OPTS.m else ROWS
    started = time.perf_counter()
    copy_bw = copy_bandwidth()
    device = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)"
    print(f"{device}; copy {copy_bw / 1e9:.0f} GB/s (read + write); {DTYPE}; {len(configs)} configs")
    print(f"{'shape':>8} {'m':>4} {'impl':<22} {'us':>9} {'GB/s':>7} {'% copy':>7} {'vs cuB':>7} {'err':>9}")
    results = []
    for name, n, k in SHAPES:
        results += bench_shape(name, n, k, configs, copy_bw, rows_list)
    summary = summarize(results)
    elapsed = time.perf_counter() - started
    print(f"{elapsed:.0f} s in all; median err of the configs "
          f"{statistics.median(r['err'] for r in results if r['impl'] != 'cublas'):.2e}")
    if OPTS.json:
        with open(OPTS.json, "w") as f:
            json.dump(dict(device=device, copy_gbps=copy_bw / 1e9, results=results, seconds=elapsed,
                           configs={c: vars(v) for c, v in configs.items()}, **summary), f, indent=1)


if __name__ == "__main__":
    main()
