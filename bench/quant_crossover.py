"""The weight-only formats both ways kernels/triton/dequant_linear.py can run them: per Llama-3-8B projection
shape and row count, the fused kernel and the whole weight dequantized then ``F.linear``, beside bf16 ``F.linear``
(the weights drawn as bench/quant_kernels.py draws them, timed by CUDA-graph replays over copies that overflow the
L2). Prints one table of speeds relative to bf16 and, per format, the row count from which dequantizing wins at
every shape: what ``DEQUANT_MIN_ROWS`` is to be set from.

``python -m kvrelay.bench.quant_crossover [--rows 32,...] [--json FILE]`` on a CUDA machine.
"""

import argparse
import json
import time
from importlib import import_module

import torch
import torch.nn.functional as F

from kvrelay.bench.gpu_measure import graph_seconds
from kvrelay.bench.quant_kernels import GROUP, SHAPES, forget_weights, weight_sets

CROSSOVER_ROWS = "32,64,128,256,512,1024,2048,8192"
# int8 per channel; "w4_fast": AWQ / GPTQ repacked at load (kernels/w4_decode.py below the threshold); "w4": the
# plain W4 layout, GPTQ act-order's whose g_idx scatters groups (kernels/triton/w4a16.py)
CROSSOVER_FORMATS = ("int8", "w4_fast", "w4")


def dispatched(fmt: str, x: torch.Tensor, d: dict, min_rows: int):
    """The registered op over one weight, as kernels/triton/dequant_linear.py runs it with ``min_rows`` as its
    threshold: 0 always dequantizes, a huge one never does."""
    dl = import_module("kvrelay.kernels.triton.dequant_linear")

    def call():
        before, dl.DEQUANT_MIN_ROWS = dl.DEQUANT_MIN_ROWS, min_rows
        try:
            if fmt == "int8":
                return dl.int8_linear(x, d["w"], d["s"])
            if fmt == "w4_fast":
                return dl.w4_packed_linear(x, d["packed"])
            return dl.w4a16_linear(x, d["w"], d["z"], d["s"], GROUP)
        finally:
            dl.DEQUANT_MIN_ROWS = before
    return call


def crossover(rows_list: list[int]) -> list[dict]:
    """The fused-vs-dequantized table (module docstring): speeds as bf16's time over the path's."""
    never, always = 1 << 62, 0
    table: dict[tuple[int, str], dict] = {}
    for name, (k, n) in SHAPES.items():
        forget_weights()
        for rows in rows_list:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k)).to(torch.bfloat16).cuda()
            _, bf16 = weight_sets("bf16", k, n)
            row = table[rows, name] = {"bf16": graph_seconds([lambda d=d, x=x: F.linear(x, d["w"]) for d in bf16])}
            for fmt in CROSSOVER_FORMATS:
                one, sets = weight_sets("w4_packed" if fmt == "w4_fast" else fmt, k, n)
                fused, deq = dispatched(fmt, x, one, never)().float(), dispatched(fmt, x, one, always)().float()
                err = ((fused - deq).abs().max() / deq.abs().max().clamp_min(1e-6)).item()
                if err > 0.02:
                    raise AssertionError(f"{fmt} {name} {rows} rows: the two paths differ by {err:.3g} (relative)")
                for path, min_rows in (("fused", never), ("deq", always)):
                    row[fmt, path] = graph_seconds([dispatched(fmt, x, d, min_rows) for d in sets])
    cols = [(fmt, path) for fmt in CROSSOVER_FORMATS for path in ("fused", "deq")]
    print("\n| rows | proj | bf16 us | " + " | ".join(f"{f} {p} vs bf16" for f, p in cols) + " |")
    print("| --- " * (3 + len(cols)) + "|")
    for (rows, name), r in sorted(table.items(), key=lambda item: item[0][0]):  # shapes in order within a count
        print(f"| {rows} | {name} | {r['bf16'] * 1e6:.1f} | " + " | ".join(f"{r['bf16'] / r[c]:.2f}x" for c in cols) + " |")
    # per format: the smallest row count from which dequantizing is faster at every shape and every larger count
    cut = {}
    for fmt in CROSSOVER_FORMATS:
        wins = {rows: all(table[rows, name][fmt, "deq"] < table[rows, name][fmt, "fused"] for name in SHAPES)
                for rows in rows_list}
        cut[fmt] = next((rows for rows in sorted(rows_list) if all(wins[r] for r in rows_list if r >= rows)), None)
    print("| dequantize from | (rows) | - | " + " | ".join(f"{cut[f]}" if p == "deq" else "-" for f, p in cols) + " |")
    return [{"rows": rows, "proj": name, **{"_".join(c) if isinstance(c, tuple) else c: t * 1e6 for c, t in r.items()}}
            for (rows, name), r in table.items()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=CROSSOVER_ROWS, help="row counts")
    p.add_argument("--json", default=None, help="also write every row here (times in us, keyed \"bf16\" and "
                   "\"<format>_<path>\")")
    args = p.parse_args(argv)
    start = time.monotonic()
    rows_out = crossover([int(r) for r in args.rows.split(",")])
    print(f"\ncrossover: {time.monotonic() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows_out, f)


if __name__ == "__main__":
    main()
