"""Prefill attention on the GPU: our paged Triton kernel against torch's flash kernels on the same causal
prompts (one layer, Llama-3-8B heads): SDPA on padded batches and ``varlen_attn`` on the packed batch.

    python -m kvrelay.bench.prefill_probe
"""

import argparse
import inspect
import time

import torch
import torch.nn.functional as F

from kvrelay import kernels
from kvrelay.bench.gpu_measure import event_ms as timed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="2x4096,8x1024,32x512")
    p.add_argument("--new-lengths", default="4096,4001,2500,1234,4096")
    args = p.parse_args(argv)
    try:
        from torch.nn.attention.varlen import varlen_attn
        print("varlen_attn", inspect.signature(varlen_attn))
    except ImportError as e:
        varlen_attn = None
        print("no varlen_attn:", e)
    for shape in args.shapes.split(","):
        num_seqs, length = (int(v) for v in shape.split("x"))
        print(probe(num_seqs, length, varlen_attn), flush=True)
    print(backends(args.new_lengths), flush=True)


def backends(lengths: str) -> str:
    """Each SDPA backend on prompt lengths it has not seen: the first call (cuDNN builds an execution plan
    per shape) and the steady state, one prompt, Llama-3-8B heads."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    lines = []
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        firsts, steadies = [], []
        try:
            for length in (int(v) for v in lengths.split(",")):
                q = torch.randn(1, 32, length, 128, device="cuda", dtype=torch.bfloat16)
                k, v = (torch.randn(1, 8, length, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                with sdpa_kernel(backend):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    torch.cuda.synchronize()
                    firsts.append((time.perf_counter() - t0) * 1e3)
                    steadies.append(timed(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                        q, k, v, is_causal=True, enable_gqa=True)))
        except Exception as e:
            lines.append(f"{name}: failed: {type(e).__name__}: {str(e)[:150]}")
            continue
        lines.append(f"{name}: first call ms {[round(f, 2) for f in firsts]}, steady ms {[round(s, 3) for s in steadies]}")
    return "\n".join(lines)


def probe(num_seqs: int, length: int, varlen_attn) -> str:
    heads, kv_heads, d, bs = 32, 8, 128, 16
    total = num_seqs * length
    blocks = total // bs
    kv = torch.randn(2, blocks, bs, kv_heads, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(total, heads, d, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(0, total + 1, length, dtype=torch.int32, device="cuda")
    meta = kernels.AttentionMetadata(
        slot_mapping=torch.arange(total, device="cuda"), query_start_loc=qsl,
        seq_lens=torch.full((num_seqs,), length, dtype=torch.int32, device="cuda"),
        block_tables=torch.arange(blocks, dtype=torch.int32, device="cuda").view(num_seqs, length // bs),
        query_start_loc_cpu=list(range(0, total + 1, length)), seq_lens_cpu=[length] * num_seqs,
        max_query_len=length, max_seq_len=length)
    k_new, v_new = (kv[i].reshape(total, kv_heads, d) for i in (0, 1))
    scale = d ** -0.5
    ours_out = kernels.paged_attention(q, kv, meta, scale, k=k_new, v=v_new)
    ours = timed(lambda: kernels.paged_attention(q, kv, meta, scale, k=k_new, v=v_new))
    qs = q.view(num_seqs, length, heads, d).transpose(1, 2)
    ks, vs = (t.view(num_seqs, length, kv_heads, d).transpose(1, 2) for t in (k_new, v_new))
    sdpa_gqa = timed(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True))
    ke, ve = (t.repeat_interleave(heads // kv_heads, dim=1).contiguous() for t in (ks, vs))
    sdpa = timed(lambda: F.scaled_dot_product_attention(qs, ke, ve, is_causal=True))
    ref = F.scaled_dot_product_attention(qs, ke, ve, is_causal=True).transpose(1, 2).reshape(total, heads, d)
    line = (f"{num_seqs} x {length}: ours {ours:.3f} ms (err {(ours_out - ref).abs().max().item():.3g}) | "
            f"SDPA expanded {sdpa:.3f} | SDPA gqa {sdpa_gqa:.3f}")
    if varlen_attn is not None:
        for label, kw, kk, vv in (("gqa", {"enable_gqa": True}, k_new, v_new),
                                  ("expanded", {}, k_new.repeat_interleave(heads // kv_heads, 1),
                                   v_new.repeat_interleave(heads // kv_heads, 1))):
            try:
                extra = dict(kw)
                if "window_size" in inspect.signature(varlen_attn).parameters:
                    extra["window_size"] = (-1, 0)
                else:
                    extra["is_causal"] = True
                def fn(kk=kk, vv=vv, extra=extra):
                    return varlen_attn(q, kk, vv, qsl, qsl, length, length, scale=scale, **extra)
                out = fn()
                out = out[0] if isinstance(out, tuple) else out
                line += f" | varlen {label} {timed(fn):.3f} (err {(out - ref).abs().max().item():.3g})"
            except Exception as e:
                line += f" | varlen {label} failed: {type(e).__name__}: {str(e)[:150]}"
    return line



if __name__ == "__main__":
    main()
