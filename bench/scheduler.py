"""``python -m bench.scheduler``: the host cost of scheduling one decode step, no model.

A decode step at batch 128 on the H200 takes ~9.7 ms on the GPU and ~2 ms on the host, and the two
serialize, so every host microsecond per step is throughput. This drives the real Scheduler and
BlockManager (prefix caching on) through decode steps of ``--batch`` requests whose contexts grow from
``--prompt-len`` tokens, feeding one fake sampled token per request per step, and prints the mean cost
of schedule() + update_from_output() per step at a few context lengths.
"""

import argparse
import time

from kvrelay.shared.config.engine import SchedulerConfig
from kvrelay.shared.engine.block_manager import BlockManager
from kvrelay.shared.engine.request import Request
from kvrelay.shared.engine.scheduler import Scheduler
from kvrelay.shared.wire.sampling_params import SamplingParams


def measure(batch: int, prompt_len: int, steps: int, block_size: int = 16) -> list[tuple[int, float]]:
    max_len = prompt_len + steps + 1
    blocks = batch * (max_len // block_size + 2)
    sched = Scheduler(SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(8192, batch * prompt_len)),
                      BlockManager(blocks, block_size), max_len)
    for i in range(batch):
        prompt = [(i * 131 + j * 7) % 30000 + 10 for j in range(prompt_len)]
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
        req.max_tokens = steps + 1
        sched.add_request(req)
    out = sched.schedule()  # the prefill step
    sched.update_from_output(out, {s.request.request_id: [5] for s in out.scheduled})
    marks, t0, done = [], time.perf_counter(), 0
    for step in range(1, steps + 1):
        out = sched.schedule()
        assert len(out.scheduled) == batch, "a request ended early: the measurement would be of a smaller batch"
        sched.update_from_output(out, {s.request.request_id: [step % 1000 + 5] for s in out.scheduled})
        if step % (steps // 4) == 0:
            now = time.perf_counter()
            marks.append((prompt_len + step, (now - t0) / (step - done)))
            t0, done = now, step
    return marks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=2048)
    args = p.parse_args()
    print(f"batch {args.batch}, prompt {args.prompt_len}, {args.steps} decode steps (prefix caching on)")
    for ctx, per_step in measure(args.batch, args.prompt_len, args.steps):
        print(f"  context up to {ctx:5d} tokens: {per_step * 1e6:8.0f} us per step "
              f"({per_step * 1e6 / args.batch:.2f} us per request)")


if __name__ == "__main__":
    main()
