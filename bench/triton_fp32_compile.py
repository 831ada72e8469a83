"""Compile time of the Triton attention kernels' fp32 paths per candidate tiling (issue #22: the GPU suite's
longest tests are fp32 cases compiling the prefill kernel for 90-115 s each).

fp32 serves correctness runs, so a tiling is judged by its compile time and its result alone. An IEEE fp32
``tl.dot`` is compiled to unrolled FMAs, so a smaller tile should compile much faster. Each (kernel, tiling)
runs in its own child process with its own empty TRITON_CACHE_DIR, so no compiled kernel or JIT state leaks
between candidates. Children run a few at a time (compiling is CPU work and the H200 host has 16 cores; six at
once start both current prefill tilings, the slowest, at once), so compile times compare within one run, not
with a lone compile. Each child times its first call (compile + run; one specialisation, where the GPU tests
compile two: with and without the step's own k/v) and a warm call, and compares the output with
kernels/reference.py in float32.

    python -m kvrelay.bench.triton_fp32_compile [--budget 230] [--jobs 6]

The current tiling (FP32_CONFIG, FP32_BLOCK_N) comes first in each kernel's rows.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from kvrelay.kernels import reference
from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.shared.config.handover import module_argv

KERNELS = ("prefill", "fp8-prefill", "decode")
TOL = 2e-4  # the fp32 tolerance of tests/kernels/triton_cases.py
FP8_SCALES = (0.5, 2.0)


def candidates() -> list[tuple[str, tuple]]:
    from kvrelay.kernels.triton import decode_attention as da
    from kvrelay.kernels.triton import prefill_attention as pa

    # the kernels' own candidate lists: tests/kernels/test_interpret.py checks each on CPU, so any of them may
    # become FP32_CONFIG / FP32_BLOCK_N after a measurement
    prefill = [pa.FP32_CONFIG] + [c for c in pa.FP32_CANDIDATES if c != pa.FP32_CONFIG]
    decode = [(da.FP32_BLOCK_N,)] + [(n,) for n in da.FP32_BLOCK_N_CANDIDATES if n != da.FP32_BLOCK_N]
    return [(k, c) for k in ("prefill", "fp8-prefill") for c in prefill] + [("decode", c) for c in decode]


def paged_case(q_lens: list[int], seq_lens: list[int], heads: int, kv_heads: int, head_dim: int, page: int,
               device: str) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """fp32 queries and a [2, N, bs, Hkv, D] cache whose blocks are shuffled across sequences."""
    gen = torch.Generator().manual_seed(0)
    per_seq = [-(-n // page) for n in seq_lens]
    width = max(per_seq)
    perm = torch.randperm(sum(per_seq) + 2, generator=gen)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    start = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = perm[start:start + n]
        start += n
    cache = torch.randn(2, len(perm), page, kv_heads, head_dim, generator=gen)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    slots = [int(tables[i, p // page]) * page + p % page
             for i, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True)) for p in range(sl - ql, sl)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables=tables.to(device),
        query_start_loc_cpu=qsl, seq_lens_cpu=list(seq_lens), max_query_len=max(q_lens), max_seq_len=max(seq_lens))
    return q.to(device), cache.to(device), meta


def run_one(kernel: str, tiling: tuple, device: str) -> dict:
    """One candidate in this process: first call, warm call, max error against the float32 reference."""
    from kvrelay.kernels.triton.decode_attention import decode_attention
    from kvrelay.kernels.triton.prefill_attention import prefill_attention

    # test_triton_gpu.py's fp32 prefill case (group 4, head_dim 128): whole prompts, chunks over a cached
    # prefix and decode rows in one mixed batch; on CPU (the interpreter, a smoke run) the interpret tests' shape
    heads, kv_heads, d, page = (16, 4, 128, 16) if device == "cuda" else (8, 2, 32, 8)
    q_lens, seq_lens = [300, 129, 1, 64, 1000, 1], [300, 1500, 2047, 864, 1000, 1]
    if device != "cuda":
        q_lens, seq_lens = [5, 1, 40, 17], [5, 70, 100, 17]
    if kernel == "decode":
        q_lens = [1] * len(seq_lens)
    q, cache, meta = paged_case(q_lens, seq_lens, heads, kv_heads, d, page, device)
    scale, kv_scale, ref_cache = d ** -0.5, None, cache
    k = v = None
    if kernel == "fp8-prefill":
        kv_scale = torch.tensor(FP8_SCALES, device=device)
        cache = torch.stack([(cache[i] * 3 / kv_scale[i]).clamp(-448, 448) for i in (0, 1)]).to(torch.float8_e4m3fn)
        ref_cache = torch.stack([cache[i].float() * kv_scale[i] for i in (0, 1)])
    elif kernel == "prefill":  # this step's keys from their own contiguous k/v, as the models pass them
        slots = meta.slot_mapping
        k, v = (cache[i, slots // page, slots % page].contiguous() for i in (0, 1))

    def call():
        if kernel == "decode":
            return decode_attention(q, cache, meta, scale, block_n=tiling[0], kv_scale=kv_scale)
        return prefill_attention(q, cache, meta, scale, k=k, v=v, config=tiling, kv_scale=kv_scale)

    def timed() -> tuple[torch.Tensor, float]:
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = call()
        if device == "cuda":
            torch.cuda.synchronize()
        return out, time.perf_counter() - t

    out, first = timed()
    warm = min(timed()[1] for _ in range(3))
    expected = reference.paged_attention(q, ref_cache, meta, scale)
    diff = (out - expected).abs()
    ok = bool((diff <= TOL * (1 + expected.abs())).all())  # assert_close's atol = rtol = TOL; NaN fails
    return {"compile_s": first, "warm_ms": warm * 1e3, "max_err": float(diff.max()), "ok": ok}


def child_main(kernel: str, tiling: str, device: str) -> None:
    try:
        row = run_one(kernel, tuple(json.loads(tiling)), device)
    except Exception as e:  # OutOfResources, a compile error: reported in the table, the run goes on
        row = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"}
    print(json.dumps(row), flush=True)


def start(kernel: str, tiling: tuple, device: str, cache_root: str) -> subprocess.Popen:
    cache_dir = tempfile.mkdtemp(prefix="triton-", dir=cache_root)
    env = {**os.environ, "TRITON_CACHE_DIR": cache_dir}
    argv = [*module_argv("kvrelay.bench.triton_fp32_compile"), "--child", kernel, json.dumps(list(tiling)),
            "--device", device]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result_of(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (err.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit {proc.returncode}: {tail[:100]}"}


def sweep(todo: list[tuple[str, tuple]], device: str, budget: float, jobs: int) -> list[tuple[str, tuple, dict]]:
    """Every candidate in a child, ``jobs`` at a time, in order; whatever is still running at the budget's end
    is killed and reported as such, and candidates not started by then are reported as skipped."""
    deadline = time.monotonic() + budget
    results: dict[int, dict] = {}
    running: dict[int, subprocess.Popen] = {}
    queue = list(enumerate(todo))
    with tempfile.TemporaryDirectory(prefix="fp32-compile-") as cache_root:
        while queue or running:
            while queue and len(running) < jobs and time.monotonic() < deadline:
                i, (kernel, tiling) = queue.pop(0)
                running[i] = start(kernel, tiling, device, cache_root)
            if time.monotonic() >= deadline:
                for i, _ in queue:
                    results[i] = {"error": "skipped: time budget spent"}
                queue = []
                for i, proc in running.items():
                    proc.kill()
                    proc.communicate()
                    results[i] = {"error": f"killed at the {budget:.0f} s budget"}
                running = {}
            for i, proc in list(running.items()):
                if proc.poll() is not None:
                    results[i] = result_of(proc)
                    del running[i]
            time.sleep(0.2)
    return [(kernel, tiling, results[i]) for i, (kernel, tiling) in enumerate(todo)]


def print_table(rows: list[tuple[str, tuple, dict]]) -> None:
    print("| kernel | tiling | compile s (first call) | warm ms | max error | ok |")
    print("| --- | --- | --- | --- | --- | --- |")
    for kernel, tiling, r in rows:
        name = f"BLOCK_N={tiling[0]}" if kernel == "decode" else str(tiling)
        if "error" in r:
            print(f"| {kernel} | {name} | - | - | - | FAILED: {r['error']} |")
        else:
            print(f"| {kernel} | {name} | {r['compile_s']:.1f} | {r['warm_ms']:.2f} | {r['max_err']:.1e} | "
                  f"{'yes' if r['ok'] else 'NO'} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=230.0, help="seconds for the whole sweep")
    p.add_argument("--jobs", type=int, default=6, help="candidates compiled at once")
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"subset of {','.join(KERNELS)}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--child", nargs=2, metavar=("KERNEL", "TILING"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child_main(*args.child, args.device)
        return
    wanted = set(args.kernels.split(","))
    todo = [(k, c) for k, c in candidates() if k in wanted]
    t0 = time.monotonic()
    rows = sweep(todo, args.device, args.budget, args.jobs)
    print_table(rows)
    print(f"\n{len(todo)} candidates, {args.jobs} at a time, {time.monotonic() - t0:.0f} s, device {args.device}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
