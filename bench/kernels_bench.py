"""Kernel benchmarks on one GPU: paged decode attention bandwidth against the HBM copy bandwidth
measured in the same process, fused vs unfused RMSNorm+residual, and SiLU·mul vs eager torch.

Run on a CUDA machine: ``PYTHONUNBUFFERED=1 python bench/kernels_bench.py`` (``--sweep`` adds a decode
tile/warps/stages sweep; ``--smoke`` runs tiny shapes on CPU through the Triton interpreter to check
the script itself). Timing (all but the copy baseline, see copy_bandwidth): each measurement captures one CUDA graph that calls the op once per input
set, rotating through enough sets (distinct block tables / tensors) that their bytes exceed the 60 MB
L2 several times over, then times graph replays with CUDA events; per-call time = median / sets.
That is how decode runs in production (graph-captured, every layer reading a cold cache).
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = argparse.ArgumentParser()
ARGS.add_argument("--smoke", action="store_true")
ARGS.add_argument("--sweep", action="store_true")
ARGS.add_argument("--decode-shapes", default=None, metavar="BxCTX,...",
                  help="only the decode sweep, on these batch x context shapes (e.g. 128x1024,1x2048)")
ARGS.add_argument("--prefill", action="store_true", help="only the prefill attention tiling sweep vs SDPA")
ARGS.add_argument("--old-prefill", default=None, help="path of an earlier prefill_attention.py to time beside")
OPTS = ARGS.parse_args()
if OPTS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"

from importlib import import_module  # noqa: E402

from kvrelay.bench.gpu_measure import call_seconds  # noqa: E402
from kvrelay.kernels import reference  # noqa: E402
from kvrelay.kernels.metadata import AttentionMetadata  # noqa: E402

tk = import_module("kvrelay.kernels.triton")
da = import_module("kvrelay.kernels.triton.decode_attention")
DEV = "cpu" if OPTS.smoke else "cuda"
ROTATE_BYTES = (1 << 30) if DEV == "cuda" else 1 << 12  # each graph touches >= 1 GiB (17x the L2) unless one call alone is larger


def time_calls(calls: list, reps: int = 15) -> float:
    """Median seconds per call over graph replays of all ``calls`` (host timer in smoke mode)."""
    return call_seconds(calls, DEV == "cuda", reps)


def n_sets(set_bytes: int, cap: int = 64) -> int:
    return max(1, min(cap, ROTATE_BYTES // max(1, set_bytes)))


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 1 GiB device-to-device copy, launched eagerly: the best of
    torch's memcpy and an SM elementwise kernel (neg). Not graph-captured: in a CUDA graph the memcpy
    became a copy node that ran at ~2,700 GB/s on an H200 (2026-11-29), below what the decode kernel
    itself read, so it is no ceiling for kernels that stream through the SMs."""
    numel = (1 << 29) if DEV == "cuda" else (1 << 16)  # 1 GiB of bf16 per buffer
    src = torch.randn(numel, device=DEV).to(torch.bfloat16)
    dst = torch.empty_like(src)
    nbytes = 2 * src.numel() * src.element_size()
    if DEV == "cpu":
        return nbytes / time_calls([lambda: dst.copy_(src)])
    best = 0.0
    for op in (lambda: dst.copy_(src), lambda: torch.neg(src, out=dst)):
        for _ in range(10):  # warm up, and let the clocks ramp
            op()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            op()
        end.record()
        end.synchronize()
        best = max(best, nbytes / (start.elapsed_time(end) / 1e3 / 20))
    return best


def decode_case(cache, batch, ctx, heads, kv_heads, head_dim, gen, **kw):
    """Per-call seconds and bytes for `batch` sequences of `ctx` tokens, blocks drawn at random."""
    page, num_blocks = cache.shape[2], cache.shape[1]
    nblk = -(-ctx // page)
    kv_bytes = batch * ctx * kv_heads * head_dim * 2 * cache.element_size()
    q = torch.randn(batch, heads, head_dim, device=DEV).to(cache.dtype)
    calls = []
    for _ in range(n_sets(kv_bytes)):
        tables = torch.randint(0, num_blocks, (batch, nblk), generator=gen).to(torch.int32).to(DEV)
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(batch, dtype=torch.int64, device=DEV),
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=DEV),
            seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=DEV), block_tables=tables,
            query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[ctx] * batch,
            max_query_len=1, max_seq_len=ctx,
        )
        calls.append(lambda meta=meta: da.decode_attention(q, cache, meta, head_dim ** -0.5, **kw))
    t = time_calls(calls)
    return t, kv_bytes + 2 * q.numel() * q.element_size()


def bench_decode(copy_bw: float) -> None:
    heads, kv_heads, head_dim, page = 32, 8, 128, 16  # Llama-3-8B, bf16
    if DEV == "cuda":
        batches, contexts, max_tokens = [1, 4, 16, 64], [1024, 4096, 16384, 32768], 64 * 32768
    else:
        batches, contexts, max_tokens = [1, 2], [64, 300], 600
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, max_tokens // page, page, kv_heads, head_dim, device=DEV).to(torch.bfloat16)
    print(f"\npaged decode attention (Llama-3-8B: 32 q / 8 kv heads, D=128, bf16, page {page}); copy = {copy_bw / 1e9:.0f} GB/s")
    print(f"{'batch':>5} {'ctx':>6} {'splits':>6} {'us':>9} {'GB/s':>7} {'% copy':>7}")
    for batch in batches:
        for ctx in contexts:
            splits = da.choose_num_splits(batch, kv_heads, ctx, torch.device(DEV))
            t, nbytes = decode_case(cache, batch, ctx, heads, kv_heads, head_dim, gen)
            print(f"{batch:>5} {ctx:>6} {splits:>6} {t * 1e6:>9.1f} {nbytes / t / 1e9:>7.0f} {100 * nbytes / t / copy_bw:>6.1f}%")
    if OPTS.sweep:
        sweep(cache, heads, kv_heads, head_dim, gen, copy_bw, batches, contexts)


def sweep(cache, heads, kv_heads, head_dim, gen, copy_bw, batches, contexts, shapes=None) -> None:
    """Tile / warps / stages and split-count alternatives on a few shapes (defaults come from here)."""
    shapes = shapes or [(batches[0], contexts[-1]), (batches[-1], contexts[1]), (batches[1], contexts[-1])]
    configs = [(64, 4, 3), (64, 4, 2), (64, 4, 4), (32, 4, 3), (32, 2, 4), (128, 4, 3), (128, 8, 3), (64, 8, 3)]
    if OPTS.decode_shapes:  # the wider search behind a change of defaults
        configs += [(64, 2, 3), (64, 2, 4), (32, 4, 4), (32, 2, 5), (64, 4, 5), (128, 8, 2), (128, 4, 2), (64, 8, 4)]
    if DEV == "cpu":
        configs = configs[:2]
    default = (da.BLOCK_N, da.NUM_WARPS, da.NUM_STAGES)
    print("\ndecode sweep: % of copy bandwidth per (BLOCK_N, num_warps, num_stages)")
    print(f"{'config':>12} " + " ".join(f"{f'b{b}/{c}':>11}" for b, c in shapes))
    for block_n, warps, stages in configs:
        da.NUM_WARPS, da.NUM_STAGES = warps, stages
        cells = []
        for b, c in shapes:
            t, nbytes = decode_case(cache, b, c, heads, kv_heads, head_dim, gen, block_n=block_n)
            cells.append(f"{100 * nbytes / t / copy_bw:>10.1f}%")
        print(f"{str((block_n, warps, stages)):>12} " + " ".join(cells))
    da.BLOCK_N, da.NUM_WARPS, da.NUM_STAGES = default
    print("\ndecode split count at (batch, ctx): % of copy bandwidth")
    for b, c in shapes:
        cells = []
        for s in (1, 2, 4, 16, 32, 64):
            t, nbytes = decode_case(cache, b, c, heads, kv_heads, head_dim, gen, num_splits=s)
            cells.append(f"s{s}={100 * nbytes / t / copy_bw:.0f}%")
        print(f"  b{b}/{c}: " + " ".join(cells))


def decode_sweep_only(copy_bw: float) -> None:
    heads, kv_heads, head_dim, page = 32, 8, 128, 16  # Llama-3-8B, bf16
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in OPTS.decode_shapes.split(",")]
    max_tokens = max(b * (-(-c // page) * page) for b, c in shapes) * (4 if DEV == "cuda" else 1)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, max_tokens // page, page, kv_heads, head_dim, device=DEV).to(torch.bfloat16)
    for b, c in shapes:
        splits = da.choose_num_splits(b, kv_heads, c, torch.device(DEV))
        t, nbytes = decode_case(cache, b, c, heads, kv_heads, head_dim, gen)
        print(f"default b{b}/{c}: splits {splits}, {t * 1e6:.1f} us, {nbytes / t / 1e9:.0f} GB/s, "
              f"{100 * nbytes / t / copy_bw:.1f}% of copy")
    sweep(cache, heads, kv_heads, head_dim, gen, copy_bw, [], [], shapes)


def bench_norm_and_act() -> None:
    hidden, inter, dt = 4096, 14336, torch.bfloat16
    tokens = [1, 16, 256, 4096] if DEV == "cuda" else [1, 8]
    w = torch.randn(hidden, device=DEV).to(dt)
    print(f"\nrmsnorm + residual (H={hidden}, bf16), per call")
    print(f"{'tokens':>6} {'fused us':>9} {'add+norm us':>11} {'torch us':>9} {'unfused/fused':>13} {'torch/fused':>11} {'fused GB/s':>10}")
    for t in tokens:
        sets = [(torch.randn(t, hidden, device=DEV).to(dt), torch.randn(t, hidden, device=DEV).to(dt))
                for _ in range(n_sets(4 * t * hidden * 2))]
        fused = time_calls([lambda x=x, r=r: tk.rms_norm(x, w, 1e-5, r) for x, r in sets])
        unfused = time_calls([lambda x=x, r=r: tk.rms_norm(x + r, w, 1e-5) for x, r in sets])
        eager = time_calls([lambda x=x, r=r: reference.rms_norm(x, w, 1e-5, r) for x, r in sets])
        gbs = 4 * t * hidden * 2 / fused / 1e9  # read x, residual; write out, new residual
        print(f"{t:>6} {fused * 1e6:>9.1f} {unfused * 1e6:>11.1f} {eager * 1e6:>9.1f} {unfused / fused:>13.2f} {eager / fused:>11.2f} {gbs:>10.0f}")
    print(f"\nsilu_mul (I={inter}, bf16), per call")
    print(f"{'tokens':>6} {'triton us':>9} {'torch us':>9} {'torch/triton':>12} {'triton GB/s':>11}")
    for t in tokens:
        sets = [torch.randn(t, 2 * inter, device=DEV).to(dt) for _ in range(n_sets(3 * t * inter * 2))]
        fast = time_calls([lambda x=x: tk.silu_mul(x) for x in sets])
        eager = time_calls([lambda x=x: reference.silu_mul(x) for x in sets])
        print(f"{t:>6} {fast * 1e6:>9.1f} {eager * 1e6:>9.1f} {eager / fast:>12.2f} {3 * t * inter * 2 / fast / 1e9:>11.0f}")


def _event_ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_prefill() -> None:
    """Prefill attention, Llama-3-8B heads, bf16: our kernel per (BLOCK_M, BLOCK_N, warps, stages),
    reading this step's keys from contiguous k/v ("fresh") or through the block table ("paged"),
    against torch SDPA on contiguous K/V in the same process. Plain prompts (2 x 4096, the bench's
    prefill step) and a chunk over a cached prefix (2 x 1024 new tokens after 3072 cached)."""
    import importlib.util

    import torch.nn.functional as F

    pa = import_module("kvrelay.kernels.triton.prefill_attention")
    old = None
    if OPTS.old_prefill:
        spec = importlib.util.spec_from_file_location("old_prefill", OPTS.old_prefill)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    heads, kv_heads, d, page = 32, 8, 128, 16
    gen = torch.Generator().manual_seed(1)
    # first run (2026-11-29) also had (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3),
    # (128, 64, 4, 3), (64, 128, 4, 3): each slower than one of these on both cases
    configs = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 8, 4)]
    if DEV == "cpu":
        heads, kv_heads, d, configs = 4, 2, 32, [(16, 16, 4, 2)]
    cases = [(2, 4096, 0), (2, 1024, 3072)] if DEV == "cuda" else [(2, 64, 0), (1, 32, 40)]
    print(f"\nprefill attention ({heads} q / {kv_heads} kv heads, D={d}, bf16, page {page}): ms (TFLOP/s), "
          "rel. error vs fp32 reference on first use")
    for num_seqs, q_len, ctx in cases:
        seq_len = q_len + ctx
        nblk = -(-seq_len // page)
        num_blocks = num_seqs * nblk + 8
        cache = torch.randn(2, num_blocks, page, kv_heads, d, device=DEV).to(torch.bfloat16)
        tables = torch.randperm(num_blocks, generator=gen)[:num_seqs * nblk].view(num_seqs, nblk).to(torch.int32).to(DEV)
        T = num_seqs * q_len
        q = torch.randn(T, heads, d, device=DEV).to(torch.bfloat16)
        pos = torch.arange(ctx, seq_len, device=DEV)
        slots = (tables[:, pos // page].long() * page + pos % page).reshape(-1)
        qsl = list(range(0, T + 1, q_len))
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
            seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=DEV), block_tables=tables,
            query_start_loc_cpu=qsl, seq_lens_cpu=[seq_len] * num_seqs, max_query_len=q_len, max_seq_len=seq_len)
        kv = cache[:, slots // page, slots % page]  # [2, T, Hkv, D]
        k, v = kv[0].contiguous(), kv[1].contiguous()
        flops = num_seqs * 4 * heads * d * (q_len * ctx + q_len * (q_len + 1) / 2)
        scale = d ** -0.5
        ref = None
        if DEV == "cuda":  # SDPA on contiguous, head-expanded K/V (causal with the prefix via an offset mask)
            full = torch.stack([cache[:, tables[i].long()].flatten(1, 2)[:, :seq_len] for i in range(num_seqs)], 1)
            ks, vs = (full[i].transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1).contiguous() for i in (0, 1))
            qs = q.view(num_seqs, q_len, heads, d).transpose(1, 2)
            if ctx == 0:
                sdpa = _event_ms(lambda qs=qs, ks=ks, vs=vs: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True))
            else:
                allowed = torch.arange(seq_len, device=DEV)[None, :] <= torch.arange(ctx, seq_len, device=DEV)[:, None]
                mask = torch.zeros(q_len, seq_len, device=DEV, dtype=q.dtype).masked_fill(~allowed, float("-inf"))
                sdpa = _event_ms(lambda qs=qs, ks=ks, vs=vs, mask=mask: F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask))
            ref = reference.paged_attention(q.float(), cache.float(), meta, scale) if T * seq_len <= 2 * 4096 * 4096 else None
            print(f"  {num_seqs} x {q_len} new after {ctx} cached: torch SDPA {sdpa:.3f} ms ({flops / sdpa / 1e9:.0f})")
        runs = [("fresh", c, dict(k=k, v=v)) for c in configs] + [("paged", c, {}) for c in configs]
        rows = []
        for name, c, kw in runs:
            def call(c=c, kw=kw, q=q, cache=cache, meta=meta, scale=scale):
                return pa.prefill_attention(q, cache, meta, scale, config=c, **kw)
            try:
                t = _event_ms(call) if DEV == "cuda" else time_calls([call])
                err = float("nan")
                if ref is not None:
                    out = call().float()
                    err = float((out - ref).norm() / ref.norm())
                rows.append((t, name, c, err))
            except Exception as e:  # a tiling that does not fit (shared memory, registers) is reported
                print(f"    {name} {c}: failed: {type(e).__name__}: {str(e)[:120]}")
        if old is not None:
            t = _event_ms(lambda q=q, cache=cache, meta=meta: old.prefill_attention(q, cache, meta, d ** -0.5))
            rows.append((t, "old kernel", None, float("nan")))
        for t, name, c, err in sorted(rows, key=lambda x: x[0]):
            print(f"    {name:>10} {str(c):>18}: {t:.3f} ms ({flops / t / 1e9:.0f} TFLOP/s) err {err:.1e}")


def main() -> None:
    if OPTS.prefill:
        if DEV == "cuda":
            print(f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        bench_prefill()
        return
    if DEV == "cuda":
        props = torch.cuda.get_device_properties(0)
        import triton

        print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    copy_bw = copy_bandwidth()
    print(f"HBM copy (read + write): {copy_bw / 1e9:.0f} GB/s")
    if OPTS.decode_shapes:
        decode_sweep_only(copy_bw)
        return
    bench_decode(copy_bw)
    bench_norm_and_act()
    print(f"HBM copy again at the end: {copy_bandwidth() / 1e9:.0f} GB/s")


if __name__ == "__main__":
    main()
