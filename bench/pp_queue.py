"""Pipeline parallelism draining every step against the batch queue (``--pipeline-batch-queue``: up to M
micro-batches of disjoint requests in flight across steps), on the same loaded model, the same prompts, in one
call: output tok/s of each, their ratio, and whether their greedy tokens agree.

    kvrelay bench pp-queue [--pp 2] [--hidden 256] [--num-prompts 16] [--output-len 32] [--repeats 3]

The model is a random llama checkpoint of 8 layers (bench/tp_check.py's) of ``--hidden`` width, float32, on the
CPU over gloo by default (``--device cuda`` for NCCL). The two modes alternate ``--repeats`` times, so a load
change on a shared machine hits both; each mode's best run is kept.
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from kvrelay.bench.tp_check import write_checkpoint


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")


def _timed(llm, prompts: list[list[int]], output_len: int) -> tuple[list[list[int]], float]:
    from kvrelay import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs], time.perf_counter() - start


def run(args: argparse.Namespace) -> dict:
    import torch

    from kvrelay import LLM
    from kvrelay.shared.engine.profile import set_pipeline_batch_queue

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 32000, (args.input_len,), generator=gen).tolist() for _ in range(args.num_prompts)]
    best = {"drain": float("inf"), "queue": float("inf")}
    tokens: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint("llama", Path(tmp), args.hidden)
        with LLM(model=str(model_dir), dtype="float32", max_model_len=512, pipeline_parallel_size=args.pp,
                 enforce_eager=args.device != "cpu", device=args.device, max_num_seqs=max(args.num_prompts, 1),
                 enable_prefix_caching=False) as llm:  # every run times the same prompts: each computes them
            _timed(llm, prompts[:2], 4)  # warm
            for _ in range(args.repeats):
                for mode in ("drain", "queue"):
                    set_pipeline_batch_queue(llm.engine.core, mode == "queue")
                    tokens[mode], seconds = _timed(llm, prompts, args.output_len)
                    best[mode] = min(best[mode], seconds)
    generated = args.num_prompts * args.output_len
    result = {"pp": args.pp, "device": args.device, "hidden": args.hidden, "num_prompts": args.num_prompts,
              "input_len": args.input_len, "output_len": args.output_len,
              "drain_tok_s": round(generated / best["drain"], 1), "queue_tok_s": round(generated / best["queue"], 1),
              "ratio": round(best["drain"] / best["queue"], 3), "tokens_equal": tokens["drain"] == tokens["queue"],
              "load_average_1m": round(os.getloadavg()[0], 2)}
    print(json.dumps(result), flush=True)
    return result
