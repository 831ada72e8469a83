"""Accuracy of each weight quantization: perplexity of one model on one fixed text, full precision
beside every method in the same run (``kvrelay bench perplexity``; tests/unit/test_quant_perplexity.py
bounds the same numbers).

Perplexity is exp(mean negative log-likelihood) of each token given the text before it, from the
engine's prompt logprobs (one prefill). The 4-bit rows are round-to-nearest group quantizations written
here in the AWQ and GPTQ checkpoint layouts (shared/engine/quant/checkpoint.py): no calibration, so they
bound what a calibrated AWQ/GPTQ checkpoint gives, and they exercise the 4-bit loading and matmul paths.
On CPU, fp8 is weight-only (activations stay in the model dtype); on GPUs with FP8 tensor cores the
activations are quantized per token too.
"""

import argparse
import math
import tempfile
import time
from pathlib import Path

from kvrelay.llm import LLM
from kvrelay.shared.engine.quant.checkpoint import quantize_checkpoint
from kvrelay.shared.wire.sampling_params import SamplingParams

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "perplexity_text.txt"
# name -> (LLM arguments, checkpoint quantization written first or None)
VARIANTS: dict[str, tuple[dict, str | None]] = {
    "fp32": ({"dtype": "float32"}, None),
    "bf16": ({"dtype": "bfloat16"}, None),
    "int8": ({"dtype": "float32", "quantization": "int8"}, None),
    "fp8": ({"dtype": "float32", "quantization": "fp8"}, None),
    "awq": ({"dtype": "float32"}, "awq"),
    "gptq": ({"dtype": "float32"}, "gptq"),
}


def perplexity(llm: LLM, token_ids: list[int]) -> float:
    out = llm.generate([{"prompt_token_ids": token_ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    nll = [-lp[tok].logprob for tok, lp in zip(token_ids[1:], out.prompt_logprobs[1:], strict=True)]
    return math.exp(sum(nll) / len(nll))


def measure(model_dir: Path, names: list[str], group_size: int, work: Path, device: str = "cpu",
            max_tokens: int = 256) -> dict[str, float]:
    """Perplexity per variant; the 4-bit checkpoints are written under ``work``."""
    results: dict[str, float] = {}
    token_ids: list[int] = []
    for name in names:
        kwargs, write = VARIANTS[name]
        path = quantize_checkpoint(model_dir, work / name, write, group_size) if write else model_dir
        llm = LLM(model=str(path), device=device, kv_cache_memory=256 << 20, max_model_len=max_tokens + 8, **kwargs)
        if not token_ids:
            token_ids = llm.engine.tokenize(TEXT.read_text())[1][:max_tokens]
        results[name] = perplexity(llm, token_ids)
        del llm
    return results


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="an HF directory (default: the shipped SmolLM2-135M)")
    p.add_argument("--group-size", type=int, default=64, help="4-bit group size (SmolLM2's 576-wide inputs: 64)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--tokens", type=int, default=256, help="the text's first this many tokens")


def run(args: argparse.Namespace) -> int:
    from kvrelay.shared.repo.model_source import resolve_model

    model_dir = Path(resolve_model(args.model or "smollm2").path)
    names = args.variants.split(",")
    with tempfile.TemporaryDirectory() as work:
        start = time.monotonic()
        results = measure(model_dir, names, args.group_size, Path(work), args.device, args.tokens)
    base = results.get("fp32") or next(iter(results.values()))
    bf16 = results.get("bf16")
    print(f"perplexity of {model_dir.name} on the first {args.tokens} tokens of {TEXT.name} ({args.device}, "
          f"{time.monotonic() - start:.0f} s)")
    for name, ppl in results.items():
        vs_bf16 = f"  {100 * (ppl / bf16 - 1):+6.2f}% vs bf16" if bf16 else ""
        print(f"  {name:6} {ppl:8.4f}  {100 * (ppl / base - 1):+6.2f}% vs fp32{vs_bf16}")
    return 0
