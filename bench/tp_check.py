"""Tensor parallelism on CUDA (NCCL): greedy tokens of TP N against TP 1 on random HF checkpoints of every
architecture, and eager decode step time of each. Needs N GPUs (the CPU/gloo path is tested in CI).

    python -m kvrelay.bench.tp_check [--tp 2] [--archs llama,gpt2,bloom] [--dtype float32] [--hidden 1024]

(``--device cpu --hidden 128`` runs the same comparison over gloo, to check the script itself.)

Prints one JSON line per architecture: tokens_equal, first mismatch, decode ms/step for TP 1 and TP N
(both eager: TP has no CUDA graphs yet) and their ratio.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def write_checkpoint(arch: str, out: Path, hidden: int) -> Path:
    from transformers import AutoModelForCausalLM, BloomConfig, GPT2Config, LlamaConfig

    common = dict(vocab_size=32000, bos_token_id=1, eos_token_id=2)
    config = {
        "llama": LlamaConfig(**common, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=8,
                             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048),
        "gpt2": GPT2Config(**common, n_embd=hidden, n_layer=8, n_head=16, n_positions=2048),
        "bloom": BloomConfig(**common, hidden_size=hidden, n_layer=8, n_head=16),
    }[arch]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # peaked logits, so greedy ties are unlikely
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    model.save_pretrained(out / arch, safe_serialization=True)
    return out / arch


def check_prompts() -> list[list[int]]:
    """16 prompts of 8-300 random ids, the same every run."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 32000, (int(n),), generator=gen).tolist() for n in torch.randint(8, 300, (16,), generator=gen)]


def first_mismatch(one: list[list[int]], many: list[list[int]]) -> tuple[int, int] | None:
    """(prompt, position) of the first token where the two runs part, or None."""
    return next(((i, j) for i, (a, b) in enumerate(zip(one, many, strict=True))
                 for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def run(model_dir: Path, tp: int, dtype: str, device: str, prompts: list[list[int]], max_new: int
        ) -> tuple[list, float]:
    from kvrelay import LLM, SamplingParams

    with LLM(model=str(model_dir), dtype=dtype, max_model_len=1024, tensor_parallel_size=tp,
             enforce_eager=device != "cpu", device=device) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(temperature=0.0, max_tokens=129,
                                                                             ignore_eos=True))
        ms = (time.perf_counter() - start) / 128 * 1000
    return [o.outputs[0].token_ids for o in outs], ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--archs", default="llama,gpt2,bloom")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    prompts = check_prompts()
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            model_dir = write_checkpoint(arch, Path(tmp), args.hidden)
            one, one_ms = run(model_dir, 1, args.dtype, args.device, prompts, 32)
            many, many_ms = run(model_dir, args.tp, args.dtype, args.device, prompts, 32)
            mismatch = first_mismatch(one, many)
            print(json.dumps({"arch": arch, "device": args.device, "tp": args.tp, "dtype": args.dtype, "tokens_equal": one == many,
                              "first_mismatch": mismatch, "decode_ms_tp1": round(one_ms, 3),
                              f"decode_ms_tp{args.tp}": round(many_ms, 3), "ratio": round(many_ms / one_ms, 3)}),
                  flush=True)


if __name__ == "__main__":
    main()
