"""Warm-up: run every step shape the scheduler can produce once, before a worker says it is ready.

On CUDA the first step of a new shape pays for Triton compiling a kernel specialisation (the prefill
tiling, integer arguments specialised on ``== 1`` and ``% 16 == 0``; the prefill kernel's sequence and
tile counts are exempt, see kernels/triton/prefill_attention.py) and for the sampler's first kernels,
seconds of TTFT for the first requests after start (BENCHMARKS.md). Decode CUDA graphs are already captured by the runner (shared/engine/cuda_graphs.py);
warm-up covers what runs eagerly: prefill chunks of each token-count class up to the token budget, a
chunk after a cached prefix, several prompts in one step, prefill mixed with decodes, each decode batch
bucket (eager decode when graphs are off, and then long contexts too), and each sampler path (greedy,
top-k/top-p/min-p, penalties, logprobs, prompt logprobs).

It drives the engine core with ordinary requests, so the shapes are the scheduler's own, not a guess at
them. Afterwards the engine is as it was: every block free, the prefix cache empty of warm-up prompts,
its hit counters, the tenants' fairness counters and the sampler's --seed stream as they were.

A model loaded beside others that keep serving (a worker's, ``kvrelay bench pool``'s) is built and warmed
up in pieces under the worker's step lock, so they step between pieces: ``build_engine`` has the runner take
it per CUDA graph it captures (cuda_graphs.py), ``warm_up`` per shape. Its weights are read holding nothing.

On the CPU nothing compiles, and no shape runs (``compiles=False``): even a 16-token prefill plus a
decode step costs a worker hundreds of milliseconds of CPU and leaves the first real request as slow as
without it, since the CPU's first-call cost is per shape.
"""

import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace

import torch

from kvrelay import kernels
from kvrelay.shared.engine.cuda_graphs import capture_sizes, graphs_held
from kvrelay.shared.engine.engine_core import EngineCore
from kvrelay.shared.wire.sampling_params import SamplingParams

log = logging.getLogger(__name__)

WARMUP_TENANT = "kvrelay-warmup"
PROGRESS_EVERY_S = 2.0

# one of each sampler path; the requests of a shape take them in turn, so batches mix them as traffic does.
SAMPLER_PATHS = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=1),
    SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
    SamplingParams(temperature=0.0, logprobs=5, prompt_logprobs=1),
)


@dataclass(frozen=True)
class Shape:
    """One warm-up round: requests with these prompt lengths enter together; ``late`` ones enter after
    the first step, so they prefill beside the others' decodes (a mixed step)."""

    name: str
    prompts: tuple[int, ...]
    late: tuple[int, ...] = ()
    new_tokens: int = 2


def token_counts(budget: int, longest: int) -> list[int]:
    """Token counts of a prefill step: powers of two from 16 up to the budget, the budget, and counts that
    are neither 1 nor a multiple of 16. They reach both prefill-attention tilings (chosen by query
    length), each class Triton specialises the other kernels' integer arguments on (1, multiples of 16,
    the rest), and the cuBLAS kernels picked by row count (each loaded on first use: CUDA's lazy loading)."""
    top = min(budget, longest)
    sizes = {1, 3, 7, top, max(1, top - 1)}
    p = 16
    while p <= top:
        sizes |= {p, min(p + 7, top)}
        p *= 2
    return sorted(s for s in sizes if s <= top)


def _split(total: int, seqs: int) -> tuple[int, ...]:
    per = total // seqs
    return (per,) * (seqs - 1) + (total - per * (seqs - 1),)


def plan(core: EngineCore, decode: bool = True) -> list[Shape]:
    """The shapes to run. ``decode``: False on a prefill worker, whose requests stop at their first token."""
    block = core.block_manager.block_size
    budget = core.scheduler.max_num_batched_tokens
    max_seqs = core.scheduler.config.max_num_seqs
    longest = core.max_model_len - 4  # room for the tokens each warm-up request samples
    counts = token_counts(budget, longest)
    shapes = [Shape(f"prefill {n}", (n,), new_tokens=1) for n in counts]
    if longest > budget:  # chunked: a full chunk, then chunks after a cached prefix of the same prompt
        shapes.append(Shape(f"chunked prefill {min(3 * budget, longest)}", (min(3 * budget, longest),), new_tokens=1))
    # several prompts in one step (at least 2 tokens each, else the step is decode-shaped)
    shapes += [Shape(f"prefill {seqs} prompts, {n} tokens", _split(n, seqs), new_tokens=1)
               for seqs in sorted({s for s in (2, 3, 16, 17) if s <= max_seqs} | {max_seqs} - {1})
               for n in counts if n >= 2 * seqs]
    if not decode:
        return shapes
    shapes.append(Shape("mixed prefill + decode", (block, 1), late=(min(budget // 2, longest),), new_tokens=4))
    shapes += [Shape(f"decode batch {b}", (1,) * b) for b in capture_sizes(max_seqs)]
    if core.runner.graphs is None:
        # eager decode splits long contexts (split-K, a power of two up to 64 chosen by context length):
        # each split count is a kernel variant, which captured graphs would have compiled at capture
        shapes += [Shape(f"decode after {n} tokens", (n,)) for n in (128 << k for k in range(7)) if n <= longest]
    return shapes


def build_engine(build: Callable[[], EngineCore], hold: AbstractContextManager | None) -> EngineCore:
    """``build()``, an EngineCore's construction, with each CUDA graph its runner captures taking ``hold`` (the
    step lock) on its own, not the build holding it throughout: graph by graph, as warm-up goes shape by shape.
    What else of the build touches state the other models share, their KV pool, the caller's pool takes the
    lock for (shared/worker/step_lock.py LockedPool)."""
    with graphs_held(hold):
        return build()


def warm_up(core: EngineCore, decode: bool = True, compiles: bool = True,
            hold: AbstractContextManager | None = None) -> int:
    """Run every planned shape once; returns how many ran. Shapes that need more KV blocks than the
    engine has free are left out (and said so): warm-up never grows a model's share of a shared pool.
    ``compiles``: False where nothing compiles (the CPU): then nothing runs. ``hold``: entered around
    each shape (a worker's step lock, so its other models keep stepping between shapes)."""
    bm = core.block_manager
    counters = bm.prefix_queries, bm.prefix_hits
    shapes = plan(core, decode) if compiles else []
    started = last = time.monotonic()
    ran = 0
    for i, shape in enumerate(shapes, 1):
        if _blocks(shape, bm.block_size) > bm.num_free_blocks:
            log.info("warm-up: %s left out (needs more KV blocks than are free)", shape.name)
            continue
        with hold or contextlib.nullcontext():
            _run(core, shape, decode, tag=f"warmup-{i}")
        ran += 1
        if time.monotonic() - last >= PROGRESS_EVERY_S or i == len(shapes):
            last = time.monotonic()
            log.info("warming up: %d/%d shapes", i, len(shapes))
    if compiles:
        attention = _warm_prefill_attention(core)
        if attention:
            log.info("warm-up: prefill attention in %d call shapes (prompts x padded length)", attention)
    if bm.num_used:
        raise RuntimeError(f"warm-up left {bm.num_used} KV blocks allocated")
    bm.prefix_queries, bm.prefix_hits = counters
    if core.scheduler.step_cost is not None:  # warm-up's step times are compiles, not what traffic will see
        core.scheduler.step_cost.forget()
    core.runner.sampler.restart_shared_stream()
    log.info("warm-up done: %d shapes in %.2fs%s", ran, time.monotonic() - started,
             "" if compiles else " (nothing compiles on this device)")
    return ran


def _warm_prefill_attention(core: EngineCore) -> int:
    """Whole prompts run at a few padded lengths through torch's attention, whose cuDNN plans are built per
    shape on first use (kernels/sdpa_prefill.py); a whole prompt is at most one step's tokens."""
    model, runner = core.runner.model, core.runner
    q_like = torch.empty(1, model.num_heads, model.head_dim, dtype=core.dtype, device=runner.device)
    budget = core.scheduler.max_num_batched_tokens
    return kernels.warm_up_prefill_attention(q_like, model.num_kv_heads, min(budget, core.max_model_len), budget)


def _blocks(shape: Shape, block_size: int) -> int:
    return sum(-(-(n + shape.new_tokens) // block_size) for n in shape.prompts + shape.late)


def _run(core: EngineCore, shape: Shape, decode: bool, tag: str) -> None:
    ids: list[str] = []

    def add(lengths: tuple[int, ...]) -> None:
        for n in lengths:
            k = len(ids)
            params = SAMPLER_PATHS[k % len(SAMPLER_PATHS)]
            params = replace(params, max_tokens=shape.new_tokens if decode else 1, ignore_eos=True)
            # distinct tokens per request: a shared prefix would turn a planned prefill into a cache hit
            first = k * 9973 % core.vocab_size
            prompt = [(first + j) % core.vocab_size for j in range(n)]
            rid = f"{tag}-{k}"
            core.add_request(core.make_request(rid, prompt, params, tenant=WARMUP_TENANT))
            ids.append(rid)

    add(shape.prompts)
    if shape.late:
        core.step()
        add(shape.late)
    while core.has_unfinished():
        core.step()
    for rid in ids:  # a prefill worker's core holds finished KV for a handoff that will not come
        core.scheduler.release_held(rid)
    # each shape starts from an empty prefix cache, so no prompt of one turns into a cache hit in the next
    core.block_manager.reset_prefix_cache()
