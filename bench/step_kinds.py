"""What one engine step costs by what it holds (issue #23 item 3: unified mode's p99 inter-token latency): B
requests decoding alone (a CUDA-graph replay), the same B beside a prompt chunk of P tokens (a mixed step), run
eagerly and, side by side, through piecewise CUDA graphs (--cudagraph-mode FULL_AND_PIECEWISE: captured pieces
around eager attention), P prompt tokens alone, and the B decodes forced eager. Synchronous stepping gives each step's wall
time and, inside it, the forward's host launch time against the GPU's tail after it (a launch that takes as long
as the step is host-bound: its cost does not follow P); async stepping (the served default) gives the gaps
between successive steps' tokens around one mixed step, as a decoding client sees them.

    python -m kvrelay.bench.step_kinds [--model dummy:llama-3-8b] [--batch 8] [--prompt-tokens 64,256,512,1024]
        [--cudagraph-mode FULL_AND_PIECEWISE]
"""

import argparse
import statistics
import time

import torch

from kvrelay import LLM, SamplingParams
from kvrelay.bench.gpu_measure import random_prompts
from kvrelay.shared.engine.profile import on_cuda, phase_points, set_async_scheduling, set_eager, set_piecewise


class StepProbe:
    def __init__(self, llm: LLM, context: int) -> None:
        self.core = llm.engine.core
        self.context = context
        self.uid = 0
        self.launch: list[float] = []  # host seconds of each forward's launch, then of its GPU tail
        self.tail: list[float] = []
        points = phase_points(self.core)
        # an eager step's forward, and a piecewise step's (its pieces' replays and eager attention)
        self.points = [points[k] for k in ("forward", "pieces") if k in points]
        self.plain = [getattr(obj, name) for obj, name in self.points]
        self.timed = [self._timer(f) for f in self.plain]
        self.pieces = set_piecewise(self.core, True)

    def _timer(self, forward):
        cuda = on_cuda(self.core)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            hidden = forward(*args, **kwargs)
            t1 = time.perf_counter()
            if cuda:
                torch.cuda.synchronize()
            self.launch.append(t1 - t0)
            self.tail.append(time.perf_counter() - t1)
            return hidden

        return timed

    def _add(self, length: int, max_tokens: int) -> str:
        self.uid += 1
        rid = f"probe-{self.uid}"
        prompt = random_prompts(1, length, self.core.vocab_size, self.uid)[0]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.core.add_request(self.core.make_request(rid, prompt, params))
        return rid

    def decoding(self, batch: int) -> list[str]:
        """``batch`` requests past their prompts, decoding."""
        ids = [self._add(self.context, self.core.max_model_len - self.context - 1) for _ in range(batch)]
        started: set[str] = set()
        while len(started) < batch:
            started.update(o.request_id for o in self.core.step() if o.new_token_ids)
        for _ in range(3):
            self.core.step()
        return ids

    def step_ms(self, timed_forward: bool = False, done: set[str] | None = None) -> float:
        """ms of one step; ``done``: gets the ids the step finished."""
        for (obj, name), timed, plain in zip(self.points, self.timed, self.plain, strict=True):
            setattr(obj, name, timed if timed_forward else plain)
        try:
            t0 = time.perf_counter()
            outs = self.core.step()
            ms = (time.perf_counter() - t0) * 1e3
        finally:
            for (obj, name), plain in zip(self.points, self.plain, strict=True):
                setattr(obj, name, plain)
        if done is not None:
            done.update(o.request_id for o in outs if o.finish_reason)
        return ms

    def sync_row(self, batch: int, prompt: int, reps: int) -> dict[str, float]:
        """Synchronous stepping: ms of a decode-only step, of the mixed step, its forward's launch and GPU tail."""
        set_async_scheduling(self.core, False)
        ids = self.decoding(batch) if batch else []
        row: dict[str, list[float]] = {k: [] for k in ("decode", "eager decode", "mixed", "launch", "tail",
                                                         "pw mixed", "pw launch", "pw tail")}
        for _ in range(reps):
            if batch:
                row["decode"] += [self.step_ms() for _ in range(3)]
                set_eager(self.core, True)
                row["eager decode"] += [self.step_ms() for _ in range(2)]
                set_eager(self.core, False)
            for prefix in ("", "pw ") if self.pieces else ("",):
                set_piecewise(self.core, prefix == "pw ")
                self._mixed(row, prefix, prompt)
        set_piecewise(self.core, True)
        self.core.abort(ids)
        while self.core.has_unfinished():
            self.core.step()
        return {k: statistics.median(v) for k, v in row.items() if v}

    def _mixed(self, row: dict[str, list[float]], prefix: str, prompt: int) -> None:
        rid = self._add(prompt, 1)  # ends at its first token: the next decode-only step is B again
        self.launch.clear()
        self.tail.clear()
        done: set[str] = set()
        row[prefix + "mixed"].append(self.step_ms(True, done))
        row[prefix + "launch"].append(self.launch[0] * 1e3)
        row[prefix + "tail"].append(self.tail[0] * 1e3)
        while rid not in done:  # a prompt longer than the step's budget takes more steps
            self.step_ms(done=done)

    def async_gaps(self, batch: int, prompt: int) -> list[float]:
        """Async stepping: ms between successive step() returns, 4 before the mixed step is scheduled and 4 after."""
        set_async_scheduling(self.core, True)
        ids = self.decoding(batch)
        gaps, last = [], time.perf_counter()
        for i in range(9):
            if i == 4:
                self._add(prompt, 1)
            self.core.step()
            now = time.perf_counter()
            gaps.append((now - last) * 1e3)
            last = now
        self.core.abort(ids)
        while self.core.has_unfinished():
            self.core.step()
        set_async_scheduling(self.core, False)
        return gaps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="dummy:llama-3-8b")
    p.add_argument("--batch", default="8,32", help="decode rows beside each prompt chunk (comma-separated)")
    p.add_argument("--prompt-tokens", default="64,256,512,1024")
    p.add_argument("--context", type=int, default=1024, help="prompt length of the decoding requests")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cudagraph-mode", default="FULL_AND_PIECEWISE",
                   help="CUDA; with FULL_AND_PIECEWISE each mixed step is timed eagerly and through the pieces")
    args = p.parse_args(argv)
    mode = {"cudagraph_mode": args.cudagraph_mode} if torch.cuda.is_available() else {}
    llm = LLM(model=args.model, load_format="dummy", max_model_len=args.max_model_len, max_num_seqs=128,
              max_prefill_tokens_with_decodes=0, **mode)  # each chunk whole: P is the step's prompt tokens
    probe = StepProbe(llm, args.context)
    prompts = [int(x) for x in args.prompt_tokens.split(",")]
    print(f"model {args.model}, decoding contexts ~{args.context} tokens, ms (medians of {args.reps})")
    print(f"{'B':>4} {'P':>5} {'decode':>8} {'eager dec':>9} {'mixed':>8} {'launch':>8} {'GPU tail':>8} "
          f"{'pw mixed':>8} {'pw launch':>9} {'pw tail':>8} {'P alone':>8}   async gaps around the mixed step "
          f"(4 before it is added, 5 after; pieces {'on' if probe.pieces else 'absent'})")
    for batch in (int(x) for x in args.batch.split(",")):
        for prompt in prompts:
            row = probe.sync_row(batch, prompt, args.reps)
            alone = probe.sync_row(0, prompt, args.reps)
            gaps = probe.async_gaps(batch, prompt) if on_cuda(probe.core) else []
            pw = [row.get(k, float("nan")) for k in ("pw mixed", "pw launch", "pw tail")]
            print(f"{batch:>4} {prompt:>5} {row['decode']:8.2f} {row['eager decode']:9.2f} {row['mixed']:8.2f} "
                  f"{row['launch']:8.2f} {row['tail']:8.2f} {pw[0]:8.2f} {pw[1]:9.2f} {pw[2]:8.2f} "
                  f"{alone['mixed']:8.2f}   "
                  + " ".join(f"{g:.1f}" for g in gaps), flush=True)


if __name__ == "__main__":
    main()
