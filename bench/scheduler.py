"""``python -m bench.scheduler``: the host cost of scheduling one decode step, no model.

A decode step at batch 128 on the H200 takes ~9.7 ms on the GPU and ~2 ms on the host, and the two
serialize, so every host microsecond per step is throughput. This drives the real scheduler and block
manager (prefix caching on; shared/engine/profile.py ``schedule_cost``) through decode steps of
``--batch`` requests whose contexts grow from ``--prompt-len`` tokens, feeding one fake sampled token
per request per step, and prints the mean cost of schedule() + update_from_output() per step at a few
context lengths.
"""

import argparse

from kvrelay.shared.engine.profile import schedule_cost


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=2048)
    args = p.parse_args()
    print(f"batch {args.batch}, prompt {args.prompt_len}, {args.steps} decode steps (prefix caching on)")
    for ctx, per_step in schedule_cost(args.batch, args.prompt_len, args.steps):
        print(f"  context up to {ctx:5d} tokens: {per_step * 1e6:8.0f} us per step "
              f"({per_step * 1e6 / args.batch:.2f} us per request)")


if __name__ == "__main__":
    main()
