"""Pipeline parallelism on CUDA (NCCL): greedy tokens of PP M (optionally × TP N) against one device on random
HF checkpoints of every architecture, and the time of one batch of 16 requests of each. Needs M × N GPUs
(the CPU/gloo path is tested in CI).

    python -m kvrelay.bench.pp_check [--pp 2] [--tp 1] [--archs llama,gpt2,bloom] [--dtype float32]

(``--device cpu --hidden 128`` runs the same comparison over gloo, to check the script itself.)

Prints one JSON line per architecture: tokens_equal, first mismatch, seconds for the batch on one device
and through the pipeline (both eager: ranks run no CUDA graphs yet) and their ratio. ``--kv-blocks`` fixes
the KV cache size (default: profiled, each stage on its own layers).
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

from kvrelay.bench.tp_check import check_prompts, first_mismatch, write_checkpoint


def run(model_dir: Path, pp: int, tp: int, args: argparse.Namespace, prompts: list[list[int]]) -> tuple[list, float]:
    from kvrelay import LLM, SamplingParams

    with LLM(model=str(model_dir), dtype=args.dtype, max_model_len=1024, pipeline_parallel_size=pp,
             tensor_parallel_size=tp, enforce_eager=args.device != "cpu", device=args.device,
             num_gpu_blocks=args.kv_blocks) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        llm.generate([{"prompt_token_ids": prompts[0][:8]}], params)  # warm
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        seconds = time.perf_counter() - start
    return [o.outputs[0].token_ids for o in outs], seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--archs", default="llama,gpt2,bloom")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--kv-blocks", type=int, default=None)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    prompts = check_prompts()
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            model_dir = write_checkpoint(arch, Path(tmp), args.hidden)
            one, one_s = run(model_dir, 1, 1, args, prompts)
            many, many_s = run(model_dir, args.pp, args.tp, args, prompts)
            mismatch = first_mismatch(one, many)
            print(json.dumps({"arch": arch, "device": args.device, "pp": args.pp, "tp": args.tp, "dtype": args.dtype,
                              "tokens_equal": one == many, "first_mismatch": mismatch,
                              "batch_s_one_device": round(one_s, 3), "batch_s_pipeline": round(many_s, 3),
                              "ratio": round(many_s / one_s, 3)}), flush=True)


if __name__ == "__main__":
    main()
