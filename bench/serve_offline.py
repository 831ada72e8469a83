"""The baseline for ``kvrelay bench serve --compare-offline``: the same prompts through the offline engine
(``kvrelay.LLM``, same engine flags) in this process, timed the way the client times the server.

Two passes on one engine:
- all at once: every prompt submitted together through ``generate_stream``; the engine's best-case
  throughput, and a TTFT that includes waiting behind every other prompt's prefill.
- same schedule: the server run's arrival times and concurrency limit replayed into the engine, so the
  TTFT difference to the served run is what the serving path adds (HTTP, queue, processes, handoff),
  not a different batching pattern. Skipped when it would equal the first pass (rate inf, no limit).
"""

import argparse
import inspect
import time
from collections import deque

from kvrelay import LLM, SamplingParams
from kvrelay.bench.serve_client import Prompt, RequestResult
from kvrelay.cli_args import add_engine_args
from kvrelay.shared.config.engine import DEFAULT_STEP_TOKENS
from kvrelay.shared.worker.gc_freeze import freeze_long_lived


def build_llm(engine_args: list[str]) -> LLM:
    p = argparse.ArgumentParser(prog="kvrelay bench serve -- [engine args]", add_help=False)
    add_engine_args(p)
    # serve's gateway flags (--port, --host, ...) may sit among the engine flags; they do not shape the engine
    ns, _ = p.parse_known_args(engine_args)
    accepted = inspect.signature(LLM).parameters
    given = vars(ns) | {"num_gpu_blocks": ns.num_gpu_blocks_override}
    if ns.max_num_batched_tokens is None and ns.enable_chunked_prefill:
        # the workers' step budget, not the offline class's larger default: the same engine as the one served
        given["max_num_batched_tokens"] = DEFAULT_STEP_TOKENS
    llm = LLM(**{k: v for k, v in given.items() if k in accepted})
    freeze_long_lived()  # as the served path's workers do (shared/worker/gc_freeze.py): the same footing
    return llm


def engine_prompts(llm: LLM, prompts: list[Prompt], endpoint: str) -> list:
    """What the gateway would have queued: token ids as given, text as is, chat rendered by the template."""
    out = []
    for p in prompts:
        if p.token_ids is not None:
            out.append({"prompt_token_ids": p.token_ids})
        elif endpoint == "chat":
            text = llm.engine.apply_chat_template([{"role": "user", "content": p.text}])
            out.append({"prompt": text, "prompt_token_ids": llm.engine.tokenize(text, add_special_tokens=False)[1]})
        else:
            out.append(p.text)
    return out


class _Timeline:
    """Per-request token timing from the engine's delta outputs, in RequestResult form."""

    def __init__(self):
        self.results: dict[str, RequestResult] = {}
        self.sent: dict[str, float] = {}
        self.last: dict[str, float] = {}

    def start(self, rid: str, at: float, prompt_len: int) -> None:
        self.sent[rid] = self.last[rid] = at
        self.results[rid] = RequestResult(prompt_tokens=prompt_len)

    def record(self, out, now: float) -> bool:
        """Applies one delta; True when that request finished."""
        rid = out.request_id
        r = self.results.get(rid)
        if r is None:  # first sight of a request submitted through generate_stream
            self.start(rid, self.sent["*"], len(out.prompt_token_ids))
            r = self.results[rid]
        c = out.outputs[0] if out.outputs else None
        if c is not None and c.token_ids:
            if r.output_tokens == 0:
                r.ttft = now - self.sent[rid]
            else:
                r.itl.append(now - self.last[rid])
            self.last[rid] = now
            r.output_tokens += len(c.token_ids)
            r.text += c.text
        if out.finished:
            r.latency = now - self.sent[rid]
            r.success = r.output_tokens > 0
        return out.finished


def all_at_once(llm: LLM, prompts: list, params: SamplingParams) -> tuple[list[RequestResult], float]:
    tl = _Timeline()
    tl.sent["*"] = start = time.perf_counter()
    for out in llm.generate_stream(prompts, params):
        tl.record(out, time.perf_counter())
    duration = time.perf_counter() - start
    return list(tl.results.values()), duration


def same_schedule(llm: LLM, prompts: list, params: SamplingParams, offsets: list[float],
                  max_concurrency: int | None) -> tuple[list[RequestResult], float]:
    engine = llm.engine
    tl = _Timeline()
    pending = deque(range(len(prompts)))
    in_flight: set[str] = set()
    start = time.perf_counter()
    while pending or in_flight:
        now = time.perf_counter()
        while pending and start + offsets[pending[0]] <= now and (
                max_concurrency is None or len(in_flight) < max_concurrency):
            i = pending.popleft()
            prompt_len = len(engine.tokenize(prompts[i])[1])
            sent = time.perf_counter()  # like the client: the clock starts before the request is handed over
            # a salt of its own: the all-at-once pass left these very prompts in the prefix cache
            rid = engine.add_request(prompts[i], params, request_id=f"replay-{i}", cache_salt="replay")
            tl.start(rid, sent, prompt_len)
            in_flight.add(rid)
        if not in_flight:
            time.sleep(max(0.0, start + offsets[pending[0]] - time.perf_counter()))
            continue
        for out in engine.step(delta=True):
            if tl.record(out, time.perf_counter()):
                in_flight.discard(out.request_id)
    duration = time.perf_counter() - start
    order = [f"replay-{i}" for i in range(len(prompts))]
    return [tl.results[rid] for rid in order], duration


def run_offline(engine_args: list[str], prompts: list[Prompt], warmup: Prompt, endpoint: str, output_len: int,
                ignore_eos: bool, offsets: list[float], max_concurrency: int | None, logprobs: bool = True
                ) -> dict[str, tuple[list[RequestResult], float]]:
    llm = build_llm(engine_args)
    # the served run's sampling, logprob included, so the engine does the same work per token
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=ignore_eos,
                            logprobs=0 if logprobs else None)
    batch = engine_prompts(llm, prompts, endpoint)
    llm.generate(engine_prompts(llm, [warmup], endpoint), params)  # first-call costs out of the timings
    passes = {"offline, all at once": all_at_once(llm, batch, params)}
    if max_concurrency is not None or any(offsets):
        passes["offline, same schedule"] = same_schedule(llm, batch, params, offsets, max_concurrency)
    return passes
