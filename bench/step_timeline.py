"""Where a step's GPU time goes, kernel by kernel, from the profiler: a batch-N decode step (one CUDA-graph
replay) or a prefill step of whole prompts (eager, as prefill runs).

    python -m kvrelay.bench.step_timeline [--model dummy:llama-3-8b] [--batch 1] [--context 32] [--prefill 2x4096]
"""

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from kvrelay import LLM, SamplingParams
from kvrelay.bench.gpu_measure import decode_step_ms, random_prompts, replay_ms
from kvrelay.shared.engine.profile import decode_graphs


def kernel_table(prof, repeats: int, top: int, wall_ms: float, label: str) -> None:
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            total[ev.name] += ev.device_time_total
            count[ev.name] += 1
    busy = sum(total.values()) / repeats / 1e3
    print(f"{label}: {wall_ms:.3f} ms, kernels busy {busy:.3f} ms ({sum(count.values()) / repeats:.0f} kernels), "
          f"GPU idle {wall_ms - busy:.3f} ms")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{us / repeats / 1e3:8.3f} ms  {count[name] / repeats:5.0f}x  {name[:110]}")


def decode(llm: LLM, batch: int, context: int, replays: int, top: int) -> None:
    step = decode_step_ms(llm, batch, context, 50)
    replay = replay_ms(llm)
    graphs = decode_graphs(llm.engine.core)
    graph = graphs.graph(*graphs.last_replayed)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernel_table(prof, replays, top, replay, f"batch-{batch} decode (step {step:.3f} ms), one graph replay")


def prefill(llm: LLM, num: int, length: int, top: int) -> None:
    vocab = llm.engine.core.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in random_prompts(num, length, vocab, 1)], params)  # warm-up
    prompts = [{"prompt_token_ids": p} for p in random_prompts(num, length, vocab, 2)]
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        llm.generate(prompts, params)
        end.record()
        torch.cuda.synchronize()
    kernel_table(prof, 1, top, start.elapsed_time(end), f"prefill of {num} x {length} tokens (one step)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="dummy:llama-3-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=32, help="prompt tokens of each decoding request (issue #22's "
                   "batch-128 row: 1024)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--prefill", default="2x4096", help="prompts x tokens of the profiled prefill step ('' skips)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--quantization", default=None, help="as LLM's quantization (fp8, int8, awq, ...)")
    p.add_argument("--w4-decode", default=None, help="the W4 decode kernel (kernels/triton/w4_decode.py's table)")
    args = p.parse_args(argv)
    if args.w4_decode:
        from kvrelay.kernels.triton import w4_decode

        w4_decode.DECODE_KERNELS[args.w4_decode]  # noqa: B018  # an unknown name fails here, before the load
        w4_decode.DECODE_KERNEL = args.w4_decode
    num, length = (int(v) for v in args.prefill.split("x")) if args.prefill else (0, 0)
    # a long context gets the KV cache sized from free memory, as `bench gpu`'s batch-128 row has it: a cache
    # sized to the batch's blocks alone ended requests inside the timed steps (H100, --batch 128 --context 1024)
    blocks = {"num_gpu_blocks": 4096} if args.context <= 256 else {}
    llm = LLM(model=args.model, load_format="dummy", quantization=args.quantization,
              max_model_len=max(2048, length + 8, args.context + 256), **blocks,
              max_num_seqs=max(16, args.batch), max_num_batched_tokens=max(8192, num * length))
    llm.generate([{"prompt_token_ids": [5] * 32}], SamplingParams(max_tokens=8, ignore_eos=True))
    decode(llm, args.batch, args.context, args.replays, args.top)
    if num:
        prefill(llm, num, length, args.top)


if __name__ == "__main__":
    main()
