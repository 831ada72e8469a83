"""The quantized matmuls alone, at Llama-3-8B's projection shapes, against the bytes they must read:
what to tune the W4A16 / W8A16 kernels (kernels/triton/w4a16.py) and the FP8 path against.

Per (K, N) and row count: bf16 ``F.linear`` (cuBLAS) as the baseline; FP8 through ``torch._scaled_mm``
with per-token activation quantization (kernels/triton/fp8_linear.py); the Triton weight-only kernels
for int8, for an fp8 weight read the same way (the weight-only FP8 path a decode row could take instead
of quantizing its activations), and for W4 with groups of 128 — each over a sweep of tile shapes and
warps, checked against the dequantize-then-matmul reference before it is timed. ``w4_fast`` (and
``w4_fast64``, K tiles of 64) is the same W4 weight repacked at load (kernels/w4_repack.py) through
kernels/triton/w4_fast.py: magic-number fp16 dequantization, tensor-core products and split K (with more
than one split, the second launch that sums the splits is in the time); its sweep starts with its default
configuration (cfg ``null``), the one the model runs, and the table sets that configuration
(``default_config``'s BLOCK_M, BLOCK_N, SPLIT) and its time beside the winner's. Every time is the median
of CUDA-graph replays over enough weight copies that each replay reads several times the 60 MB L2 (so a
decode step's cold reads are what is timed), and is printed beside its floor: the weight bytes (scales
and zero points included) over the copy bandwidth measured in the same process.

``w4_gemv`` (kernels/triton/w4_gemv.py: the same repacked weight through a tensor-core-free GEMV for 1-16 rows,
split K summed in order), ``w4_gemv_atomic`` (split K by fp32 atomics, the last split of a tile writing the
output: kernels/triton/split_arrival.py) and ``w4_gemv_h2`` (kernels/triton/w4_gemv_h2.py: one row, the weights
dequantized and multiplied in fp16 pairs, split K the same way) are the decode candidates for
kernels/triton/w4_decode.py's table; each tries its default (cfg ``null``) and a few tile shapes at five splits,
and the table sets the default's time beside the best. ``fp8_gemm`` and ``fp8_gemm_tensor``: cuBLASLt's fp8 GEMM
alone, row-wise against scalar scales; ``bf16_kn``: ``F.linear`` over the bf16 weight stored as [K, N] (a
transposed view), which ties with [N, K] at prefill sizes (BENCHMARKS.md, 2026-12-07 22:06); ``fp8_triton``: the
same row-wise product through kernels/triton/fp8_gemm.py, its named tile configs swept; ``bf16_triton``: that
kernel's schedule on the bf16 weight (K tiles halved, unit scales), against cuBLAS's bf16 GEMM: whether a Triton
GEMM with a fused epilogue could take cuBLAS's place at prefill sizes (``--rows 4096,16384
--formats bf16,bf16_kn,bf16_triton,fp8_gemm,fp8_gemm_tensor,fp8_triton``).

``python -m kvrelay.bench.quant_kernels`` on a CUDA machine; ``--quick`` sweeps fewer configurations.
``--rows 1,4,16 --formats bf16,w4_fast,w4_gemv,w4_gemv_atomic --quick``: the W4
decode comparison (one shape's weights are drawn once, on the GPU, for all its row counts);
``--rows 1 --formats w4_gemv_atomic,w4_gemv_h2``: the one-row GEMVs.
``--rows 1,4,16 --formats w4_fast,w4_fast64``: the decode sweep that ``default_config``'s tiles and split
are to be set from.
bench/quant_crossover.py times the weight-only formats' two paths (fused kernel, or dequantize then ``F.linear``)
against each other on the weights drawn here.
"""

import argparse
import itertools
import json
import time
from dataclasses import replace
from importlib import import_module

import torch
import torch.nn.functional as F

from kvrelay.bench.gpu_measure import graph_seconds
from kvrelay.kernels import quant
from kvrelay.kernels.w4_repack import repack_w4

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
GROUP = 128
L2_BYTES = 60 << 20


# the formats that read the repacked W4 weight; all but w4_fast64 (K tiles of 64) share one draw of it ("w4_packed")
W4_PACKED = ("w4_packed", "w4_fast64")
SHARED_W4 = ("w4_fast", "w4_gemv", "w4_gemv_atomic", "w4_gemv_h2")


def weights(fmt: str, k: int, n: int, copies: int, gen: torch.Generator) -> list[dict]:
    """``copies`` distinct weights of one format on the GPU (distinct so the L2 cannot serve a replay), drawn
    there (``gen`` a CUDA generator): drawing gate_up's copies on the host took longer than timing them."""
    out = []
    for _ in range(copies):
        if fmt in ("bf16", "bf16_kn"):
            w = (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).to(torch.bfloat16)
            # bf16_kn: the same [N, K] weight as a view of its [K, N] transpose stored contiguous, the layout a
            # dequantized W4 weight has (cuBLAS then runs an "NN" GEMM where nn.Linear's weight runs "TN")
            out.append({"w": w.t().contiguous().t() if fmt == "bf16_kn" else w})
        elif fmt in ("int8", "fp8"):
            w, s = quant.quantize_channel(torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5, fmt)
            out.append({"w": w, "s": s})
        else:
            q = torch.randint(0, 16, (k, n), generator=gen, device="cuda", dtype=torch.int32)
            d = {"w": quant.pack_w4(q),
                 "z": torch.randint(0, 16, (k // GROUP, n), generator=gen, device="cuda").to(torch.uint8),
                 "s": (torch.rand(k // GROUP, n, generator=gen, device="cuda") * 0.5 / k ** 0.5
                       + 0.01 / k ** 0.5).half()}
            if fmt in W4_PACKED:  # the same weight, repacked; "unpacked" is the reference's
                p = repack_w4(d["w"], d["z"], d["s"], GROUP, tile_k=64 if fmt == "w4_fast64" else None)
                d = {"w": p.qweight, "z": p.zeros, "s": p.scales, "packed": p, "unpacked": d}
            out.append(d)
    return out


def nbytes(d: dict) -> int:
    return sum(t.numel() * t.element_size() for t in d.values() if isinstance(t, torch.Tensor))


def reference(fmt: str, x: torch.Tensor, d: dict) -> torch.Tensor:
    """What ``fmt`` computes, in fp32: fp8_mm also rounds the activations to e4m3 per token."""
    if fmt == "fp8_mm":
        return quant.fp8_linear_w8a8(x.float(), d["w"], d["s"])
    x = x.float()
    if fmt in ("bf16", "bf16_kn", "bf16_triton"):
        return F.linear(x, d["w"].float())
    if fmt.startswith("w4"):
        d = d.get("unpacked", d)
        return quant.w4a16_linear(x, d["w"], d["z"], d["s"], GROUP)
    return F.linear(x, quant.dequantize_channel(d["w"], d["s"]))


def configs(fmt: str, rows: int, quick: bool) -> list[tuple]:
    """What to try: (BLOCK_N, BLOCK_K, num_warps) of the skinny loop; else (BLOCK_M, BLOCK_N, BLOCK_K,
    num_warps, num_stages), the GEMV kernel for <= 8 rows."""
    if fmt.endswith("_sk"):  # None: skinny_linear's own choice for the shape, timed beside the best
        ns, ks, ws = ((8,), (1024,), (4,)) if quick else ((2, 4, 8, 16), (512, 1024, 2048, 4096), (2, 4, 8))
        # the [BLOCK_N, BLOCK_K] fp32 products stay in registers: at most 64 a thread, or ptxas spills them
        return [None] + [(bn, bk, w) for bn, bk, w in itertools.product(ns, ks, ws) if bn * bk <= 64 * 32 * w]
    if fmt in GEMV_CONFIGS:  # (BLOCK_N, BLOCK_R, SPLIT, num_warps, num_stages); None: the default
        # SPLIT is an argument, not a compiled constant: each tile shape is tried at the default's split (0), a
        # half, a quarter, twice and four times it (negative: a divisor of the default, resolved in kernel_call)
        # for one compile. num_stages 3 lets Triton keep the next chunks' words in flight while this one is
        # summed, which only a split of several chunks a program has to gain from (the default gives one row's
        # programs one or two chunks each)
        if rows > GEMV_SWEEP_ROWS:
            return [None]
        tiles = GEMV_CONFIGS[fmt][0 if rows == 1 else 1]
        tiles = tiles[:2] if quick else tiles
        return [None] + [(bn, br, sp, w, st) for bn, br, w in tiles for st in GEMV_STAGES for sp in (0, -2, -4, 2, 4)]
    if fmt.startswith("w4_fast"):  # (BLOCK_M, BLOCK_N, SPLIT, num_warps, num_stages); None: the default
        ms = (16,) if rows <= 16 else (32,) if rows <= 32 else (64, 128)
        ns, splits = ((32, 64, 128), (1, 2, 4, 8, 16)) if rows <= 16 else ((64, 128), (1, 2))
        launch = ((4, 3),) if quick else ((4, 3), (4, 4), (8, 3))
        return [None] + [(bm, bn, sp, *ws) for bm, bn, sp, ws in
                         itertools.product(ms, ns, splits[:2] if quick else splits, launch)]
    if rows <= 8:
        ns, ks, ws = ((16, 32), (128,), (4,)) if quick else ((8, 16, 32, 64), (128, 256, 512, 1024), (4, 8))
        return [(1, bn, bk, w, 2) for bn, bk, w in itertools.product(ns, ks, ws)]
    ms = (16,) if rows <= 32 else (64, 128)
    ns, ks, ws, ss = ((64,), (64,), (4,), (3,)) if quick else ((64, 128), (64, 128), (4, 8), (3, 4))
    return [(bm, bn, bk, w, s) for bm, bn, bk, w, s in itertools.product(ms, ns, ks, ws, ss)
            if not (quick and bm == 128)]


# the decode GEMVs' tile shapes (BLOCK_N, BLOCK_R, num_warps), for one row and for more: kernels/triton/w4_gemv.py's
# want BLOCK_N a multiple of 128 x num_warps (4 columns a thread; 8 with twice that); with more rows, fewer
# registers a row (ptxas spilled BLOCK_R 16 at 4 rows, 8 columns at 16)
GEMV_MAX_ROWS = 16  # kernels/triton/w4_gemv.py's MAX_ROWS
# beyond 4 rows the GEMVs run their default only, and w4_gemv_atomic, which differs from w4_gemv in the split-K
# sum only, not at all: a 16-row build took ptxas 91 s on a busy CPU, and spilled; w4_fast's tensor cores are
# the 16-row candidate
GEMV_SWEEP_ROWS = 4
GEMV_STAGES = (1, 3)
GEMV_CONFIGS = {
    "w4_gemv": ([(1024, 8, 4), (512, 8, 4), (512, 16, 4), (512, 8, 2), (256, 16, 2), (2048, 8, 8)],
                [(512, 4, 4), (512, 8, 4), (256, 4, 2), (256, 8, 2)]),
    "w4_gemv_atomic": ([(1024, 8, 4), (512, 8, 4), (512, 16, 4)], [(512, 4, 4), (256, 4, 2)]),
    # one row only (more take w4_gemv_atomic): more columns a thread share its activation pairs among more words
    "w4_gemv_h2": ([(1024, 8, 4), (512, 8, 4), (2048, 8, 4), (1024, 16, 4), (1024, 8, 2), (1024, 16, 2), (512, 8, 2)],
                   []),
}


def gemv_call(fmt: str, x: torch.Tensor, d: dict, cfg: tuple | None):
    """The decode GEMVs (kernels/triton/w4_gemv.py, w4_gemv_h2.py); a negative SPLIT divides the default's."""
    gemv = import_module("kvrelay.kernels.triton.w4_gemv")
    p = d["packed"]
    if cfg is not None and cfg[2] != 0:
        bn, br, sp, *launch = cfg
        n, k = p.shape
        auto = gemv.split_for(n, bn, k // 8 // br, x.device)
        cfg = (bn, br, max(1, auto // -sp) if sp < 0 else auto * sp, *launch)
    if fmt == "w4_gemv_h2":
        h2 = import_module("kvrelay.kernels.triton.w4_gemv_h2")
        return lambda: h2.w4_gemv_h2_linear(x, p, cfg=cfg)
    atomic = fmt == "w4_gemv_atomic"
    return lambda: gemv.w4_gemv_linear(x, p, atomic=atomic, cfg=cfg)


def kernel_call(fmt: str, x: torch.Tensor, d: dict, rows: int, cfg: tuple | None):
    # by module path: kernels.triton re-exports functions under their modules' names
    fp8_linear = import_module("kvrelay.kernels.triton.fp8_linear")
    skinny = import_module("kvrelay.kernels.triton.skinny_linear")
    w4a16 = import_module("kvrelay.kernels.triton.w4a16")
    w4_fast = import_module("kvrelay.kernels.triton.w4_fast")

    gemv = rows <= w4a16.GEMV_MAX_ROWS
    if fmt in ("bf16", "bf16_kn"):
        return lambda: F.linear(x, d["w"])
    if fmt == "bf16_triton":
        gemm = import_module("kvrelay.kernels.triton.fp8_gemm")
        ones_m = torch.ones(x.shape[0], device=x.device)
        ones_n = torch.ones(d["w"].shape[0], device=x.device)
        return lambda: gemm.fp8_gemm(x, ones_m, d["w"], ones_n, config=cfg)
    if fmt == "fp8_mm":  # the tensor-core path, whatever the row count
        return lambda: fp8_linear.fp8_linear(x, d["w"], d["s"]) if rows > 1 else fp8_mm_forced(x, d)
    if fmt in FP8_GEMM_ALONE:
        return fp8_gemm_alone(fmt, x, d, cfg)
    if fmt.endswith("_sk"):
        return lambda: skinny.scaled_linear(x, d["w"], d["s"], cfg=cfg)
    if fmt in GEMV_CONFIGS:
        return gemv_call(fmt, x, d, cfg)
    if fmt.startswith("w4_fast"):
        return lambda: w4_fast.w4_packed_linear(x, d["packed"], cfg=cfg)
    if fmt == "w4":
        return lambda: w4a16.w4a16_linear(x, d["w"], d["z"], d["s"], GROUP, gemv=gemv, cfg=cfg)
    return lambda: w4a16.int8_linear(x, d["w"], d["s"], gemv=gemv, cfg=cfg)  # int8, and fp8 weight-only


# cuBLASLt's fp8 GEMM alone, the activations quantized per token before the timing: with the row-wise scales the
# model runs (fp8_gemm), and with both scales one scalar each (fp8_gemm_tensor), which cuBLASLt serves with other
# kernels than row-wise ("ovscale") ones. Their ratio is what row-wise scaling costs a prefill GEMM; the scalar
# variant's output is the unscaled product times the scales' products' means, checked against that, not the model.
FP8_GEMM_ALONE = ("fp8_gemm", "fp8_gemm_tensor", "fp8_triton")


def fp8_gemm_alone(fmt: str, x: torch.Tensor, d: dict, cfg: str | None = None):
    from kvrelay.kernels.triton.fp8_quant import quantize_per_token_fp8

    xq, x_scale = quantize_per_token_fp8(x)
    if fmt == "fp8_triton":
        gemm = import_module("kvrelay.kernels.triton.fp8_gemm")
        return lambda: gemm.fp8_gemm(xq, x_scale, d["w"], d["s"], config=cfg)
    if fmt == "fp8_gemm":
        return lambda: torch._scaled_mm(xq, d["w"].t(), scale_a=x_scale, scale_b=d["s"].view(1, -1).float(),
                                        out_dtype=torch.bfloat16)
    sa, sb = x_scale.float().mean().reshape(()), d["s"].float().mean().reshape(())
    return lambda: torch._scaled_mm(xq, d["w"].t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


def fp8_gemm_alone_reference(fmt: str, x: torch.Tensor, d: dict) -> torch.Tensor:
    from kvrelay.kernels.triton.fp8_quant import quantize_per_token_fp8

    xq, x_scale = quantize_per_token_fp8(x)
    product = xq.float() @ d["w"].float().t()
    if fmt in ("fp8_gemm", "fp8_triton"):
        return product * x_scale.float() * d["s"].float().view(1, -1)
    return product * x_scale.float().mean() * d["s"].float().mean()


def fp8_mm_forced(x: torch.Tensor, d: dict) -> torch.Tensor:
    """One row through per-token quantization and torch._scaled_mm, which fp8_linear sends to the skinny loop."""
    from kvrelay.kernels.triton.fp8_quant import quantize_per_token_fp8

    xq, x_scale = quantize_per_token_fp8(x)
    return torch._scaled_mm(xq, d["w"].t(), scale_a=x_scale, scale_b=d["s"].view(1, -1), out_dtype=torch.bfloat16)


_sets: dict[tuple, tuple[dict, list[dict]]] = {}


def forget_weights() -> None:
    """Drop the drawn weights (before the next shape's: one shape's copies fill a good part of the device)."""
    _sets.clear()
    torch.cuda.empty_cache()


def weight_sets(store: str, k: int, n: int) -> tuple[dict, list[dict]]:
    """(one weight, the copies a replay cycles through, that one first), drawn once per format and shape and
    kept for the other row counts (main runs each shape's row counts together, then drops them)."""
    if (store, k, n) not in _sets:
        gen = torch.Generator(device="cuda").manual_seed(k * 7 + n)
        one = weights(store, k, n, 1, gen)[0]
        copies = max(1, min(16, 4 * L2_BYTES // nbytes(one) + 1))
        _sets[store, k, n] = (one, [one] + weights(store, k, n, copies - 1, gen))
    return _sets[store, k, n]


def skipped(fmt: str, rows: int) -> bool:
    """The skinny loop is for one row, the decode GEMVs for a few."""
    return ((fmt.endswith("_sk") and rows > 1) or (fmt in GEMV_CONFIGS and rows > GEMV_MAX_ROWS)
            or (fmt == "w4_gemv_atomic" and rows > GEMV_SWEEP_ROWS) or (fmt == "w4_gemv_h2" and rows > 1))


def measure(fmt: str, name: str, k: int, n: int, rows: int, bandwidth: float, quick: bool) -> dict:
    store = {"fp8_mm": "fp8", "fp8_wo": "fp8", "fp8_sk": "fp8", "int8_sk": "int8", "fp8_gemm": "fp8",
             "fp8_gemm_tensor": "fp8", "fp8_triton": "fp8", "bf16_triton": "bf16"}.get(fmt, fmt)
    store = "w4_packed" if fmt in SHARED_W4 else store
    one, sets = weight_sets(store, k, n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k * 7 + n + rows)).to(torch.bfloat16).cuda()
    floor_us = nbytes(one) / bandwidth * 1e6
    row = {"fmt": fmt, "proj": name, "rows": rows, "weight_mb": nbytes(one) / 1e6, "floor_us": floor_us}
    expected = (fp8_gemm_alone_reference(fmt, x, one) if fmt in FP8_GEMM_ALONE else
                reference(fmt if fmt in ("bf16", "bf16_kn", "bf16_triton", "fp8_mm") or fmt.startswith("w4") else store,
                          x, one))
    if skipped(fmt, rows):
        return row
    tries = [None] if fmt in ("bf16", "bf16_kn", "fp8_mm", *FP8_GEMM_ALONE) else configs(fmt, rows, quick)
    if fmt == "fp8_triton":  # None: its default, timed beside the best
        tries = [None, *import_module("kvrelay.kernels.triton.fp8_gemm").CONFIGS]
    elif fmt == "bf16_triton":  # two-byte tiles: half the K tile keeps the same shared memory
        gemm_configs = import_module("kvrelay.kernels.triton.fp8_gemm").CONFIGS.values()
        tries = list(dict.fromkeys(replace(c, block_k=c.block_k // 2) for c in gemm_configs))
    if fmt.startswith("w4_fast"):  # what cfg None runs
        w4_fast = import_module("kvrelay.kernels.triton.w4_fast")
        row["default_cfg"] = w4_fast.default_config(rows, n, k // one["packed"].tile_k, x.device)
    elif fmt.endswith("_sk"):
        skinny = import_module("kvrelay.kernels.triton.skinny_linear")
        row["default_cfg"] = skinny.config(n, k, one["w"].element_size())
    elif fmt == "w4_gemv_h2":
        module = import_module("kvrelay.kernels.triton.w4_gemv_h2")
        row["default_cfg"] = module.default_config(n, k, one["packed"].tile_k, x.device)
    elif fmt in GEMV_CONFIGS:
        module = import_module("kvrelay.kernels.triton.w4_gemv")
        row["default_cfg"] = module.default_config(rows, n, k, one["packed"].tile_k, x.device)
    best = None
    for cfg in tries:
        try:
            got = kernel_call(fmt, x, one, rows, cfg)().float()
        except Exception as exc:  # a tile shape the compiler refuses (shared memory, registers): skip it
            why = str(exc).strip().splitlines()
            row.setdefault("refused", []).append(f"{cfg}: {type(exc).__name__}: {why[-1][:300] if why else ''}")
            continue
        err = ((got - expected).abs().max() / expected.abs().max().clamp_min(1e-6)).item()
        if err > 0.02:
            row.setdefault("wrong", []).append(f"{cfg}: rel err {err:.3g}")
            continue
        try:
            t = graph_seconds([kernel_call(fmt, x, d, rows, cfg) for d in sets])
        except Exception as exc:  # e.g. an op that cannot be captured in a graph: recorded, the sweep goes on
            row.setdefault("refused", []).append(f"{cfg}: timing: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        if cfg is None:
            row["default_us"], default_err = t * 1e6, err
        if best is None or t < best[0]:
            best = (t, cfg, err)
    if "default_us" in row and len(tries) > 1:
        # timed again last, the lower kept: the first timing after a shape's weights were drawn ran up to 15%
        # slow (the same tiles, timed first and later), which would charge the default with it
        t = graph_seconds([kernel_call(fmt, x, d, rows, None) for d in sets])
        row["default_us"] = min(row["default_us"], t * 1e6)
        if t < best[0]:
            best = (t, None, default_err)
    if best is not None:
        row.update(us=best[0] * 1e6, of_floor=floor_us / (best[0] * 1e6), cfg=best[1], rel_err=best[2])
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few configurations per shape")
    p.add_argument("--rows", default="1,128,4096", help="row counts")
    p.add_argument("--formats", default="bf16,fp8_mm,fp8_sk,int8_sk,fp8_wo,int8,w4,w4_fast,w4_fast64")
    p.add_argument("--json", default=None, help="also write every row here")
    args = p.parse_args(argv)
    from kvrelay.bench.gpu_measure import copy_bandwidth

    start = time.monotonic()
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    rows_out = []
    for name, (k, n) in SHAPES.items():
        forget_weights()
        for rows in (int(r) for r in args.rows.split(",")):
            base = None
            for fmt in args.formats.split(","):
                r = measure(fmt, name, k, n, rows, bandwidth, args.quick)
                if fmt == "bf16":
                    base = r.get("us")
                if base and r.get("us"):
                    r["vs_bf16"] = base / r["us"]
                rows_out.append(r)
                print(json.dumps(r), flush=True)
    print("\n| rows | proj | fmt | us | floor us | of floor | vs bf16 | best cfg | default us | default cfg |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(rows_out, key=lambda r: r["rows"]):  # stable: shapes in order within a row count
        if skipped(r["fmt"], r["rows"]):
            continue
        if "us" in r:
            default_us = f"{r['default_us']:.1f}" if "default_us" in r else "-"
            print(f"| {r['rows']} | {r['proj']} | {r['fmt']} | {r['us']:.1f} | {r['floor_us']:.1f} | "
                  f"{r['of_floor']:.0%} | {r.get('vs_bf16', 0):.2f}x | {r['cfg']} | {default_us} | "
                  f"{r.get('default_cfg', '-')} |")
        else:
            print(f"| {r['rows']} | {r['proj']} | {r['fmt']} | failed: {r.get('wrong') or r.get('refused')} |")
    print(f"\nsweep: {time.monotonic() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows_out, f)


if __name__ == "__main__":
    main()
