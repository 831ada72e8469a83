"""``python -m bench.engine_step``: where a decode step's time goes on the host, and what freezing the
garbage collector's view of long-lived objects (shared/worker/gc_freeze.py) saves, in the same process.

One EngineCore (no tokenizer, no output processing) decodes ``--batch`` requests; each step's time is split
into the runner (model + sampling), the scheduler (schedule + update) and the rest (output assembly and,
unfrozen, the cyclic collector's passes, which land wherever an allocation triggers them).
"""

import argparse
import json
import subprocess
import sys
import time

import torch

from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvrelay.shared.config.handover import module_argv
from kvrelay.shared.engine import EngineCore
from kvrelay.shared.engine.profile import phase_points
from kvrelay.shared.wire.sampling_params import SamplingParams
from kvrelay.shared.worker.gc_freeze import freeze_long_lived


def timed(core: EngineCore, steps: int) -> dict[str, float]:
    spent = {"runner": 0.0, "scheduler": 0.0}
    originals = []

    def wrap(obj, name: str, key: str) -> None:
        f = getattr(obj, name)
        originals.append((obj, name, f))

        def w(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t

        setattr(obj, name, w)

    points = phase_points(core)
    wrap(*points["execute"], "runner")
    wrap(*points["schedule"], "scheduler")
    wrap(*points["update"], "scheduler")
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    total = time.perf_counter() - t0
    for obj, name, f in originals:
        setattr(obj, name, f)
    out = {k: v / steps * 1e6 for k, v in spent.items()}
    out["rest"] = total / steps * 1e6 - sum(out.values())
    out["step"] = total / steps * 1e6
    return out


def child(args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(1)
    cfg = EngineConfig(model=ModelConfig(model=args.model, load_format="dummy", max_model_len=512),
                       cache=CacheConfig(num_gpu_blocks=args.batch * 40), device=args.device,
                       scheduler=SchedulerConfig(max_num_seqs=args.batch))
    core = EngineCore(cfg)
    for i in range(args.batch):
        core.add_request(core.make_request(f"r{i}", [(i * 7 + j) % 200 + 5 for j in range(32)],
                                           SamplingParams(max_tokens=400, ignore_eos=True), None))
    for _ in range(10):
        core.step()
    if args.child == "frozen":
        freeze_long_lived()  # what workers and the offline engine now do once their models are loaded
    return timed(core, args.steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="dummy:tiny-llama")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--device", default="cpu")
    p.add_argument("--child", choices=["as-is", "frozen"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    print(f"{args.model}, batch {args.batch}, {args.steps} decode steps from 42 tokens of context, {args.device}; "
          "a fresh process per run, alternating")
    runs: dict[str, list[dict]] = {"as-is": [], "frozen": []}
    for _ in range(2):
        for mode in runs:
            argv = [*module_argv("kvrelay.bench.engine_step"), "--child", mode, *sys.argv[1:]]
            out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            runs[mode].append(r)
            print(f"  {mode:7} step {r['step']:7.0f} us: runner {r['runner']:6.0f}, scheduler {r['scheduler']:5.0f}, "
                  f"rest {r['rest']:5.0f}")
    mean = {m: {k: sum(r[k] for r in rs) / len(rs) for k in rs[0]} for m, rs in runs.items()}
    print(f"  frozen / as-is: step {mean['frozen']['step'] / mean['as-is']['step']:.3f}x, "
          f"rest {mean['frozen']['rest'] / mean['as-is']['rest']:.3f}x")


if __name__ == "__main__":
    main()
