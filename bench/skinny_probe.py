"""Few-token linear layers on the GPU: cuBLAS against kernels/triton/skinny_linear.py's configs, per
weight shape of a model, unfused ops against the fused prologues; prints the best config per shape.

Weights rotate over enough copies to overflow L2 (a decode step reads each weight once, from HBM), and
each variant runs as a CUDA graph of ``--calls`` launches so launch cost does not hide kernel time.

    python -m kvrelay.bench.skinny_probe --json out.json
"""

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from kvrelay.bench.gpu_measure import copy_bandwidth, graph_seconds
from kvrelay.kernels import reference
from kvrelay.kernels.triton import skinny_linear as sl
from kvrelay.kernels.triton.rms_norm import rms_norm
from kvrelay.kernels.triton.silu_mul import silu_mul

# Llama-3-8B: (name, N, K, prologue) of each projection a decode step runs
LLAMA3_8B = [("qkv", 6144, 4096, sl.ADD_NORM), ("o", 4096, 4096, sl.NONE), ("gate_up", 28672, 4096, sl.ADD_NORM),
             ("down", 4096, 14336, sl.SILU), ("lm_head", 128256, 4096, sl.NONE)]
# (BLOCK_N, BLOCK_K, num_warps) of the kernel's load-and-FMA loop
CONFIGS = [(bn, bk, w) for bn, bk, w in itertools.product((2, 4, 8, 16), (512, 1024, 2048), (4, 8))]


def graph_ms(fn, calls: int, reps: int = 5) -> float:
    """Median GPU ms of one ``fn()`` over graph replays of ``calls`` launches."""
    return graph_seconds([fn] * calls, reps) * 1e3


class Rotating:
    """``copies`` weights of one shape used in turn, so consecutive calls read HBM, not L2."""

    def __init__(self, n: int, k: int, dtype: torch.dtype, min_bytes: int = 512 << 20) -> None:
        per = n * k * dtype.itemsize
        self.weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02
                        for _ in range(max(2, -(-min_bytes // per)))]
        self.i = 0

    def next(self) -> torch.Tensor:
        self.i = (self.i + 1) % len(self.weights)
        return self.weights[self.i]


def probe_shape(name: str, n: int, k: int, prologue: int, rows: int, bw: float, calls: int) -> dict:
    dtype = torch.bfloat16
    ws = Rotating(n, k, dtype)
    x = torch.randn(rows, 2 * k if prologue == sl.SILU else k, device="cuda", dtype=dtype)
    res = torch.randn(rows, k, device="cuda", dtype=dtype)
    nw = torch.randn(k, device="cuda", dtype=dtype)
    floor_ms = n * k * dtype.itemsize / (bw / 2) * 1e3  # bw counts read + write; a weight is only read
    out: dict = {"shape": name, "N": n, "K": k, "rows": rows, "floor_ms": floor_ms}
    out["cublas_ms"] = graph_ms(lambda: F.linear(x[:, :k], ws.next()), calls)

    def unfused():
        if prologue == sl.ADD_NORM:
            h, _ = rms_norm(x, nw, 1e-5, res)
        elif prologue == sl.SILU:
            h = silu_mul(x)
        else:
            h = x
        return F.linear(h, ws.next())
    out["unfused_ms"] = graph_ms(unfused, calls)

    # correctness of the fused form against the reference ops, once, before timing
    w0 = ws.weights[0]
    got = sl.skinny_linear(x, w0, prologue=prologue, residual=res if prologue == sl.ADD_NORM else None,
                           norm_weight=nw, eps=1e-5)
    got = got[0] if isinstance(got, tuple) else got
    if prologue == sl.ADD_NORM:
        h, _ = reference.rms_norm(x, nw, 1e-5, res)
    elif prologue == sl.SILU:
        h = reference.silu_mul(x)
    else:
        h = x
    want = F.linear(h, w0)
    out["max_err"] = (got.float() - want.float()).abs().max().item()
    out["ref_max"] = want.float().abs().max().item()

    timings = []
    for cfg in CONFIGS if rows == 1 and n <= sl.MAX_FEATURES else []:  # the kernel takes one row, N up to the cap
        try:
            ms = graph_ms(lambda cfg=cfg: sl.skinny_linear(
                x, ws.next(), prologue=prologue, residual=res if prologue == sl.ADD_NORM else None,
                norm_weight=nw, eps=1e-5, cfg=cfg), calls)
        except Exception as e:  # a config that does not compile (shared memory) is skipped, not fatal
            print(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:120]}")
            continue
        timings.append((ms, cfg))
    timings.sort()
    out["best"] = [{"ms": ms, "config": cfg} for ms, cfg in timings[:5]]
    out["default"] = sl.config(n, k)
    out["default_ms"] = next((ms for ms, cfg in timings if cfg == out["default"]), None)
    best_ms = timings[0][0] if timings else float("nan")
    print(f"{name:8s} M={rows:2d} N={n:6d} K={k:5d}: floor {floor_ms * 1e3:7.1f} us | cuBLAS {out['cublas_ms'] * 1e3:7.1f} "
          f"| unfused {out['unfused_ms'] * 1e3:7.1f} | fused best {best_ms * 1e3:7.1f} us "
          f"({floor_ms / best_ms:.0%} of floor, {out['unfused_ms'] / best_ms:.2f}x unfused) {timings[0][1] if timings else ''}"
          f" | default {out['default']} {(out['default_ms'] or float('nan')) * 1e3:7.1f} us"
          f" | err {out['max_err']:.3g} of {out['ref_max']:.3g}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:,.0f} GB/s (read + write)")
    results = [probe_shape(name, n, k, pro, rows, bw, args.calls)
               for rows in (int(r) for r in args.rows.split(",")) for name, n, k, pro in LLAMA3_8B]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bw": bw, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
