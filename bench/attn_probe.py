"""Prefill attention of whole prompts on the GPU: torch SDPA against our registered op and the paged Triton
kernel on the same causal prompts (one layer, Llama-3-8B heads, q and k contiguous and v a strided slice of
the fused projection, as the model hands them over); then a whole-model prefill run with whole prompts
through SDPA (kernels/sdpa_prefill.py) and through the paged Triton kernel.

    python -m kvrelay.bench.attn_probe [--shapes 2x4096,8x1024,32x512,4096+2500+1234] [--model-run]
"""

import argparse
import importlib
import time

import torch
import torch.nn.functional as F

from kvrelay import kernels
from kvrelay.bench.gpu_measure import event_ms
from kvrelay.kernels.triton.prefill_attention import prefill_attention as paged_prefill

# the module, not the function of the same name that kvrelay.kernels.triton exports
registered = importlib.import_module("kvrelay.kernels.triton.paged_attention")
H, HKV, D = 32, 8, 128


def inputs(lens: list[int]):
    total = sum(lens)
    qkv = torch.randn(total, H + 2 * HKV, D, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, :H].contiguous()  # rotary's output is contiguous
    k = qkv[:, H:H + HKV].contiguous()
    v = qkv[:, H + HKV:]  # the projection's slice: token stride (H + 2 Hkv) D
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    blocks = total // 16 + len(lens)
    kv = torch.zeros(2, blocks, 16, HKV, D, device="cuda", dtype=torch.bfloat16)
    tables, b = [], 0
    per = max(-(-n // 16) for n in lens)
    for n in lens:
        tables.append(list(range(b, b + -(-n // 16))) + [0] * (per - -(-n // 16)))
        b += -(-n // 16)
    meta = kernels.AttentionMetadata(
        slot_mapping=torch.arange(total, device="cuda"),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
        block_tables=torch.tensor(tables, dtype=torch.int32, device="cuda"),
        query_start_loc_cpu=starts, seq_lens_cpu=lens, max_query_len=max(lens), max_seq_len=max(lens))
    return q, k, v, kv, meta


def reference(q, k, v, lens) -> torch.Tensor:
    outs, s = [], 0
    for n in lens:
        qs, ks, vs = (t[s:s + n].transpose(0, 1)[None] for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)[0].transpose(0, 1))
        s += n
    return torch.cat(outs)


def probe(lens: list[int]) -> None:
    q, k, v, kv, meta = inputs(lens)
    scale = D ** -0.5
    flops = sum(4 * H * n * n * D / 2 for n in lens)
    ref = reference(q, k, v, lens)
    rows = []

    def add(name, fn, check=True):
        try:
            out = fn()
            err = (out.float() - ref.float()).abs().max().item() if check else float("nan")
            t0 = time.perf_counter()
            ms = event_ms(fn, 20)
            rows.append((name, ms, err, time.perf_counter() - t0))
        except Exception as e:  # noqa: BLE001 - a probe: report and go on
            rows.append((name, float("nan"), float("nan"), 0.0))
            print(f"  {name}: {type(e).__name__}: {str(e)[:200]}")

    if len(set(lens)) == 1:
        s, n = len(lens), lens[0]
        qs = q.view(s, n, H, D).transpose(1, 2).contiguous()
        ks, vs = (t.reshape(s, n, HKV, D).transpose(1, 2).contiguous() for t in (k, v))
        kx, vx = (t.repeat_interleave(H // HKV, dim=1) for t in (ks, vs))
        add("sdpa, K/V expanded (bench gpu's baseline)",
            lambda: F.scaled_dot_product_attention(qs, kx, vx, is_causal=True), check=False)
        add("sdpa, enable_gqa, BHSD contiguous", lambda: F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, enable_gqa=True), check=False)
        add("sdpa, one call on views of the packed rows", lambda: F.scaled_dot_product_attention(
            q.view(s, n, H, D).transpose(1, 2), k.view(s, n, HKV, D).transpose(1, 2),
            v.as_strided((s, HKV, n, D), (n * v.stride(0), v.stride(1), v.stride(0), 1)),
            is_causal=True, enable_gqa=True).transpose(1, 2).reshape(s * n, H, D))
    add("registered op", lambda: kernels.paged_attention(q, kv, meta, scale, k=k, v=v))
    add("paged Triton kernel", lambda: paged_prefill(q, kv, meta, scale, None, k, v))
    base = rows[0][1]
    print(f"\n### {'+'.join(map(str, lens))} tokens, one layer ({flops / 1e9:.0f} GFLOP causal)")
    print("| variant | ms | TFLOP/s | vs first row | max abs err vs SDPA |\n| --- | --- | --- | --- | --- |")
    for name, ms, err, _ in rows:
        print(f"| {name} | {ms:.3f} | {flops / ms / 1e9:.0f} | {base / ms:.2f}x | {err:.4f} |")


def model_run(prompts: int, length: int) -> None:
    """Whole-prompt prefill on Llama-3-8B (dummy), ``prompts`` x ``length`` tokens and as many prompts of random
    lengths from 1,024 to ``length``: whole prompts through SDPA, then through the paged Triton kernel (as if no
    step were made of whole prompts). Every run has prompts of its own (no prefix-cache hits)."""
    import random

    from kvrelay import LLM
    from kvrelay.bench.prefill_steps import run_once
    llm = LLM(model="dummy:llama-3-8b", load_format="dummy", max_model_len=length + 8, max_num_seqs=128,
              max_num_batched_tokens=8192)
    vocab = llm.engine.core.vocab_size
    spans = registered.prompt_spans
    seed = 0

    def prompt_set(lengths: list[int]) -> list[list[int]]:
        nonlocal seed
        seed += 1
        rng = random.Random(seed)
        return [[rng.randrange(100, vocab - 100) for _ in range(n)] for n in lengths]

    rng = random.Random(0)
    sets = {f"{prompts} x {length}": [length] * prompts,
            f"{prompts} of 1,024-{length} tokens": [rng.randint(1024, length) for _ in range(prompts)]}
    for set_name, lengths in sets.items():
        for _rep in range(2):
            for name, fn in (("whole prompts through SDPA", spans), ("the paged Triton kernel", lambda meta: None)):
                registered.prompt_spans = fn
                run_once(llm, prompt_set(lengths[:4]))
                secs = run_once(llm, prompt_set(lengths))
                print(f"prefill {set_name}, {name}: {sum(lengths) / secs:,.0f} tok/s ({secs:.3f} s)", flush=True)
    registered.prompt_spans = spans


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="2x4096,8x1024,4x2048,4096+2500+1234,1100+1100+3000+1500")
    p.add_argument("--model-run", action="store_true")
    p.add_argument("--with-engine", action="store_true", help="time the layer with a loaded Llama-3-8B engine beside it")
    args = p.parse_args(argv)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if args.with_engine:  # as bench gpu times it: the engine's KV cache holds most of the memory
        from kvrelay import LLM
        engine = LLM(model="dummy:llama-3-8b", load_format="dummy", max_model_len=4104, max_num_batched_tokens=8192)
        print("engine loaded:", engine.engine.core.vocab_size, flush=True)
    for shape in args.shapes.split(","):
        if "x" in shape:
            count, n = (int(x) for x in shape.split("x"))
            lens = [n] * count
        else:
            lens = [int(x) for x in shape.split("+")]
        probe(lens)
    if args.model_run:
        model_run(32, 4096)


if __name__ == "__main__":
    main()
