"""Where a batch-1 decode step's GPU time goes: every kernel of one CUDA-graph replay, from the profiler.

    python -m kvrelay.bench.decode_timeline [--model dummy:llama-3-8b] [--batch 1]
"""

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from kvrelay import LLM, SamplingParams
from kvrelay.bench.gpu_measure import decode_step_ms, replay_ms
from kvrelay.shared.engine.profile import decode_graphs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="dummy:llama-3-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    llm = LLM(model=args.model, load_format="dummy", max_model_len=2048, num_gpu_blocks=2048, max_num_seqs=16)
    llm.generate([{"prompt_token_ids": [5] * 32}], SamplingParams(max_tokens=8, ignore_eos=True))
    step = decode_step_ms(llm, args.batch, 32, 50)
    replay = replay_ms(llm)
    graphs = decode_graphs(llm.engine.core)
    graph = graphs.graph(*graphs.last_replayed)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.replays):
            graph.replay()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            total[ev.name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            count[ev.name] += 1
    busy = sum(total.values()) / args.replays / 1e3
    print(f"batch {args.batch}: step {step:.3f} ms, replay {replay:.3f} ms, kernels {busy:.3f} ms busy "
          f"({sum(count.values()) / args.replays:.0f} kernels), idle between kernels {replay - busy:.3f} ms")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{us / args.replays / 1e3:8.3f} ms  {count[name] / args.replays:5.0f}x  {name[:110]}")


if __name__ == "__main__":
    main()
