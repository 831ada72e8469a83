"""Where a tiny model's logprobs part from HF's, position by position, with the KV cache in fp8 and in
the model's dtype (``python -m kvrelay.bench.fp8_kv_positions``): the engine on ``--device`` against HF
transformers in fp32 with and without fp8 rounding of its cache (tests/unit/test_kv_fp8_models.py's
references). Prints, per prompt and run, the positions whose error exceeds ``--tol`` and the worst one.
"""

import argparse
import tempfile
from pathlib import Path

from kvrelay import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--arch", default="llama")
    p.add_argument("--tol", type=float, default=0.02)
    args = p.parse_args()
    from tests.conftest import make_tiny_model, random_prompts
    from tests.unit.test_kv_fp8_models import _logprobs, _reference

    model_dir = str(make_tiny_model(args.arch, Path(tempfile.mkdtemp()) / args.arch))
    prompts = random_prompts(6, lo=20, hi=60, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, prompt_logprobs=0)
    for kv in ("fp8", "auto"):
        for chunk in (16,):
            llm = LLM(model=model_dir, dtype="float32", kv_cache_dtype=kv, num_gpu_blocks=256, max_model_len=128,
                      max_num_batched_tokens=chunk, max_num_seqs=16, device=args.device, enforce_eager=True)
            outs = llm.generate([{"prompt_token_ids": q} for q in prompts], params)
            worst = (0.0, None)
            for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
                ids = prompt + list(out.outputs[0].token_ids)
                ref = _reference(model_dir, ids, round_kv=kv == "fp8")
                bad = []
                for pos, tok, lp in _logprobs(prompt, out):
                    err = abs(lp - ref[pos, tok].item())
                    if err > args.tol:
                        bad.append((pos, round(err, 3), "gen" if pos >= len(prompt) - 1 else "prompt"))
                    if err > worst[0]:
                        worst = (err, (i, pos, len(prompt)))
                if bad:
                    print(f"kv={kv} chunk={chunk} prompt {i} (len {len(prompt)}): {bad[:10]}", flush=True)
            print(f"kv={kv} chunk={chunk}: worst {worst}", flush=True)
            del llm


if __name__ == "__main__":
    main()
