"""Where a whole-prompt prefill run loses time outside its kernels: P prompts x L tokens with max_tokens=1,
for several token budgets per step, async scheduling off and on, on one loaded model; then one run under
the profiler for GPU busy against wall time, and the top kernels of the engine step at batch 1 (the graph
replay plus everything the step launches outside it: input copies, sampling).

    python -m kvrelay.bench.prefill_steps [--model dummy:llama-3-8b] [--prompts 32] [--len 4096]
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvrelay import LLM, SamplingParams
from kvrelay.bench.gpu_measure import decode_step_ms, random_prompts
from kvrelay.bench.step_timeline import kernel_table
from kvrelay.shared.engine.profile import set_async_scheduling, set_token_budget


def run_once(llm: LLM, prompts: list[list[int]]) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="dummy:llama-3-8b")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--len", type=int, default=4096)
    p.add_argument("--budgets", default="8192,16384")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",")]
    llm = LLM(model=args.model, load_format="dummy", max_model_len=max(4096, args.len + 8),
              max_num_seqs=128, max_num_batched_tokens=max(budgets))
    core = llm.engine.core
    vocab = core.vocab_size
    run_once(llm, random_prompts(2, args.len, vocab, 1))  # warm-up
    tokens = args.prompts * args.len
    for budget in budgets:
        set_token_budget(core, budget)
        for on in (False, True):
            set_async_scheduling(core, on)
            secs = run_once(llm, random_prompts(args.prompts, args.len, vocab, 2 + budget + on))
            print(f"budget {budget}, async {'on ' if on else 'off'}: {tokens / secs:,.0f} tok/s ({secs:.3f} s, "
                  f"{tokens // budget} steps, {secs / (tokens / budget) * 1e3:.1f} ms/step)")
    set_token_budget(core, budgets[0])
    set_async_scheduling(core, True)
    prompts = random_prompts(args.prompts, args.len, vocab, 99)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        secs = run_once(llm, prompts)
    kernel_table(prof, 1, args.top, secs * 1e3, f"prefill {args.prompts} x {args.len}, budget {budgets[0]}, async")
    for on in (False, True):
        set_async_scheduling(core, on)
        decode_step_ms(llm, 1, 32, 20)  # warm
        steps = 40
        prof = profile(activities=[ProfilerActivity.CUDA])  # started once the prompt's prefill is done
        ms = decode_step_ms(llm, 1, 32, steps, before_timing=prof.start)
        torch.cuda.synchronize()
        prof.stop()
        kernel_table(prof, steps, args.top, ms, f"batch-1 engine step, async {on}")


if __name__ == "__main__":
    main()
