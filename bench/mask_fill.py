"""The host's token-mask fill for structured outputs, alone: 64 matchers of the 10-field schema, each step
filled in one batch call and advanced by a token drawn uniformly from its mask (what a random-weight
model's sampling does), per grammar vocabulary and fill thread count.

Two vocabularies: the tokenizer's own (what the engine declares to xgrammar) and the tokenizer padded to a
128,256-row model (what it declared before: every id past the tokenizer an extra rejected token). Prints
the median and p90 fill per step.

Run: ``python -m kvrelay.bench.mask_fill --tokenizer DIR [--threads 1 2 4 8] [--steps 80]``.
"""

import argparse
import json
import os
import random
import statistics
import time

import torch

from kvrelay.bench.grammar_backends import SCHEMA10
from kvrelay.shared.engine.structured.bitmask import allowed_ids
from kvrelay.shared.engine.structured.tokenizer_info import tokenizer_info
from kvrelay.shared.text.tokenizer import load_tokenizer

BATCH = 64


def _walk(xgr, compiled, vocab: int, known: int, threads: int, steps: int) -> list[float]:
    """Fill times (s) of ``steps`` batch fills, the matchers advanced by a random allowed token each step."""
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(BATCH)]
    mask = torch.zeros((BATCH, (vocab + 31) // 32), dtype=torch.int32)
    batch = xgr.BatchGrammarMatcher(max_threads=threads)
    rng = random.Random(0)
    times = []
    for _ in range(steps):
        live = [m for m in matchers if not m.is_terminated()]
        if not live:
            break
        t0 = time.perf_counter()
        batch.batch_fill_next_token_bitmask(live, mask, list(range(len(live))))
        times.append(time.perf_counter() - t0)
        for i, m in enumerate(live):
            ids = allowed_ids(mask[i], known)
            if ids:
                m.accept_token(rng.choice(ids))
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--padded-vocab", type=int, default=128256)
    args = p.parse_args(argv)
    import xgrammar as xgr

    tok = load_tokenizer(args.tokenizer)
    known = len(tok)
    print(f"cores available: {len(os.sched_getaffinity(0))}; tokenizer {known} tokens; batch {BATCH}")
    for vocab in (known, args.padded_vocab):
        info = tokenizer_info(tok, vocab, [tok.eos_token_id])  # as the engine builds it
        compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA10),
                                                                                any_whitespace=False)
        for threads in args.threads:
            times = sorted(_walk(xgr, compiled, vocab, known, threads, args.steps))
            p90 = times[int(0.9 * (len(times) - 1))]
            print(f"grammar vocab {vocab:>7}  threads {threads}  fill median {statistics.median(times) * 1e3:6.2f} ms"
                  f"  p90 {p90 * 1e3:6.2f} ms  ({len(times)} steps)", flush=True)


if __name__ == "__main__":
    main()
