"""Whether FP8 GEMMs with fast accumulation can be the default: ``python -m kvrelay.bench.fp8_accum_probe``.

Fast accumulation (``torch._scaled_mm(..., use_fast_accum=True)``) ran fp8 prefill 8% faster on an H100, but a
bf16 fp8 model's fused-vs-unfused token test failed under it from the first token, though both paths hand the
GEMM the same bytes. This asks, on the GPU, the questions that decide it:

1. kernel: do two identical fast-accumulation calls give the same bits; do the fused norm's and the unfused
   quantization's e4m3 rows and scales match byte for byte; does the operand's address (offset by 16-256 bytes)
   change the result (cuBLASLt picks its algorithm by alignment, and another algorithm sums in another order);
   how far is each accumulation from an fp32 reference, in bf16 steps (ULPs) of the reference;
2. model: the dummy Llama-3-8B fp8 (``--model``), greedy, fast accumulation fused twice, unfused once, exact once: the first
   position where two runs' tokens part, and the top-2 log-probability margin the first run had there (a margin
   near 0 is a tie the dummy weights' flat logits make likely, not an error).
"""

import argparse
import functools

import torch

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # Llama-3-8B: qkv, o, gate_up, down (K, N)


def _ulps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest |got - ref| in bf16 steps at the reference's RMS magnitude. Not at each element's own: an
    output near zero (sums that cancel) has a tiny step, and an error of ordinary size there read as 10^37 ULPs."""
    rms = ref.pow(2).mean().sqrt().clamp_min(2.0 ** -126)
    step = torch.ldexp(torch.ones_like(rms), torch.frexp(rms).exponent - 8)
    return ((got - ref).abs().max() / step).item()


def kernel_checks(rows: int) -> None:
    from kvrelay.kernels import quant
    from kvrelay.kernels.triton import fp8_prologue
    from kvrelay.kernels.triton.fp8_quant import quantize_per_token_fp8
    from kvrelay.kernels.triton.rms_norm import rms_norm

    print(f"| K x N, {rows} rows | same bits twice (fast) | fused = unfused bytes | fast at +16..256 B = fast | "
          "exact vs fp32 | fast vs fp32 | fast vs exact (max, bf16 steps at the RMS) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for k, n in SHAPES:
        gen = torch.Generator().manual_seed(k + n)
        weight, wscale = quant.quantize_channel(torch.randn(n, k, generator=gen) / k ** 0.5, "fp8")
        weight, wscale = weight.cuda(), wscale.cuda()
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).cuda()
        norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(torch.bfloat16).cuda()
        fused_q, fused_s, _ = fp8_prologue.rms_norm_fp8(x, norm_w, 1e-5)
        plain_q, plain_s = quantize_per_token_fp8(rms_norm(x, norm_w, 1e-5))
        same_bytes = torch.equal(fused_q.view(torch.uint8), plain_q.view(torch.uint8)) and torch.equal(fused_s, plain_s)

        def mm(q, s, fast, weight=weight, wscale=wscale, n=n):
            return torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=wscale.view(1, n).float(),
                                    out_dtype=torch.bfloat16, use_fast_accum=fast).float()

        fast, exact = mm(fused_q, fused_s, True), mm(fused_q, fused_s, False)
        twice = torch.equal(fast, mm(fused_q, fused_s, True))
        moved = []
        for offset in (16, 32, 64, 128, 256):  # the same rows at another address
            buf = torch.empty(rows * k + offset, dtype=torch.uint8, device="cuda")
            shifted = buf[offset:].view(torch.float8_e4m3fn).view(rows, k)
            shifted.copy_(fused_q)
            moved.append(torch.equal(mm(shifted, fused_s, True), fast))
        ref = (fused_q.float() * fused_s) @ (weight.float() * wscale.view(n, 1)).t()
        print(f"| {k} x {n} | {twice} | {same_bytes} | {'all' if all(moved) else moved} | {_ulps(exact, ref):.1f} | "
              f"{_ulps(fast, ref):.1f} | {_ulps(fast, exact):.1f} |")


def model_checks(model: str, prompts: int, length: int, tokens: int) -> None:
    from kvrelay import LLM, SamplingParams
    from kvrelay.kernels.triton import fp8_prologue

    real_mm, real_fits = torch._scaled_mm, fp8_prologue.fits
    llm = LLM(model=model, load_format="dummy", dtype="bfloat16", quantization="fp8",
              max_model_len=length + tokens + 8, max_num_seqs=prompts, async_scheduling=False,
              # eager: a captured graph would keep the GEMMs it was captured with
              **({"enforce_eager": True} if torch.cuda.is_available() else {}))
    gen = torch.Generator().manual_seed(0)
    vocab = llm.engine.core.vocab_size
    ids = [torch.randint(10, vocab - 10, (length,), generator=gen).tolist() for _ in range(prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=2)

    def run(fast: bool, fused: bool):
        torch._scaled_mm = functools.partial(real_mm, use_fast_accum=fast)
        fp8_prologue.fits = real_fits if fused else (lambda x, cols: False)
        try:
            return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in ids], params)]
        finally:
            torch._scaled_mm, fp8_prologue.fits = real_mm, real_fits

    runs = {"exact, fused": run(False, True), "fast, fused": run(True, True), "fast, fused again": run(True, True),
            "fast, unfused": run(True, False), "exact, unfused": run(False, False)}
    base = runs["fast, fused"]
    print(f"\n{prompts} prompts of {length} ids, {tokens} greedy tokens each; against 'fast, fused':")
    print("| run | prompts whose tokens part | first parting position (min) | top-2 margin there, nats (max) |")
    print("| --- | --- | --- | --- |")
    for name, outs in runs.items():
        if name == "fast, fused":
            continue
        parts, margins = [], []
        for a, b in zip(base, outs, strict=True):
            at = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), None)
            if at is None:
                continue
            top = sorted(a.logprobs[at].values(), key=lambda lp: -lp.logprob)[:2]
            parts.append(at)
            margins.append(top[0].logprob - top[1].logprob if len(top) == 2 else float("nan"))
        print(f"| {name} | {len(parts)} of {prompts} | {min(parts) if parts else '-'} | "
              f"{max(margins) if margins else float('nan'):.4f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048, help="kernel checks: activation rows (prefill tokens)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--len", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--model", default="dummy:llama-3-8b")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--skip-kernels", action="store_true")
    args = ap.parse_args(argv)
    if not args.skip_kernels:
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
            raise SystemExit("the kernel checks need an FP8 GPU (compute capability 8.9+): --skip-kernels")
        print(torch.cuda.get_device_name(), "torch", torch.__version__)
        kernel_checks(args.rows)
    if not args.skip_model:
        model_checks(args.model, args.prompts, args.len, args.tokens)


if __name__ == "__main__":
    main()
