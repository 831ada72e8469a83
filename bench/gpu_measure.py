"""Measurements behind ``kvrelay bench gpu``: device ceilings, engine step times, HF baselines.

Each function measures one thing on the current CUDA device and returns plain numbers; bench/gpu.py
runs them in order and prints the table.
"""

import random
import statistics
import time

import torch

from kvrelay import LLM, SamplingParams
from kvrelay.shared.engine.profile import decode_graphs, phase_points, set_async_scheduling


# -- ceilings ---------------------------------------------------------------------------------------
def copy_bandwidth(gib: float = 1.0, reps: int = 20) -> float:
    """Bytes read + written per second by a large device-to-device copy, timed with CUDA events and
    launched eagerly (inside a graph the memcpy becomes a copy node that ran slower on an H200)."""
    src = torch.randn(int(gib * (1 << 29)), device="cuda").to(torch.bfloat16)  # gib GiB of bf16
    dst = torch.empty_like(src)
    for _ in range(5):  # warm up, let the clocks ramp
        dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def call_seconds(calls: list, cuda: bool, reps: int = 15) -> float:
    """Seconds per call: ``graph_seconds`` on CUDA; on the CPU (a bench's smoke run through the Triton
    interpreter, where only the script is checked) one warm pass, then one timed pass on the host clock."""
    if cuda:
        return graph_seconds(calls, reps)
    for c in calls:
        c()
    t0 = time.perf_counter()
    for c in calls:
        c()
    return (time.perf_counter() - t0) / len(calls)


def graph_seconds(calls: list, reps: int = 20) -> float:
    """Median seconds of one call: ``calls`` (each run once eagerly first, to compile and warm up) captured
    in one CUDA graph, replayed ``reps`` times and timed with CUDA events."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times) / len(calls)


def matmul_flops(n: int = 8192, reps: int = 10) -> float:
    """bf16 FLOP/s of an n x n x n product on random data (zeros run faster and would flatter it)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) / 1e3)


# -- our engine ---------------------------------------------------------------------------------------
def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` ids from ``seed``'s stream. One seed gives the same leading ids at any length, so
    timed prompts take a seed of their own (generate_seconds refuses a timing that hit the prefix cache)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


_uid = 0


def decode_step_ms(llm: LLM, batch: int, input_len: int, steps: int, warm: int = 5, seed: int = 0,
                   before_timing=None) -> float:
    """Mean wall ms of one engine-core step with ``batch`` requests all decoding (scheduler, inputs,
    forward, sampling, outputs: everything a step does), after their prefill and ``warm`` steps."""
    global _uid
    core = llm.engine.core
    # Room to decode until aborted: a long batch prefills over many chunked steps, and the first prompts
    # decode meanwhile, so a budget of steps + warm would end them inside the timed window (a batch of
    # 128 at 1k context shrank to ~40 and timed under its own floor).
    params = SamplingParams(temperature=0.0, max_tokens=core.max_model_len - input_len, ignore_eos=True)
    ids = []
    for p in random_prompts(batch, input_len, core.vocab_size, seed):
        _uid += 1
        ids.append(f"bench-{_uid}")
        core.add_request(core.make_request(ids[-1], p, params))
    started: set[str] = set()
    while len(started) < batch:  # prefill (possibly over several chunked steps)
        started.update(o.request_id for o in core.step() if o.new_token_ids)
    for _ in range(warm):
        core.step()
    if before_timing is not None:
        before_timing()
    t0 = time.perf_counter()
    ended = [o.request_id for _ in range(steps) for o in core.step() if o.finish_reason]
    elapsed = time.perf_counter() - t0
    core.abort(ids)
    if ended:
        raise RuntimeError(f"{len(ended)} of the {batch} requests ended inside the timed steps: not a batch of {batch}")
    return elapsed / steps * 1e3


class _Timed:
    """Stands in for a method or callable object: adds its host seconds to ``host[key]`` and, with
    ``spans``, brackets it with CUDA events; other attributes pass through (``sampler.free``)."""

    def __init__(self, fn, key: str, host: dict[str, float], spans: list | None) -> None:
        self._fn, self._key, self._host, self._spans = fn, key, host, spans

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        if self._spans is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        out = self._fn(*args, **kwargs)
        if self._spans is not None:
            end.record()
            self._spans.append((start, end))
        self._host[self._key] = self._host.get(self._key, 0.0) + time.perf_counter() - t0
        return out

    def __getattr__(self, name: str):
        return getattr(self._fn, name)


def decode_step_breakdown(llm: LLM, batch: int, input_len: int, steps: int) -> dict[str, float]:
    """``decode_step_ms`` with the step taken apart: host ms per step in the scheduler, the runner's
    input building, the replay launch, the sampler (which includes waiting for the GPU) and the rest;
    and the GPU ms of the copy + replay as it ran inside the real steps (CUDA events around it)."""
    points = phase_points(llm.engine.core)
    host: dict[str, float] = {}
    spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    originals = {}

    def wrap(obj, name: str, key: str, events: bool = False) -> None:
        fn = getattr(obj, name)
        originals[obj, name] = vars(obj).get(name)  # an instance attribute (the sampler) or None (a method)
        setattr(obj, name, _Timed(fn, key, host, spans if events else None))

    wrap(*points["schedule"], "schedule")
    wrap(*points["update"], "update")
    wrap(*points["build inputs"], "build inputs")
    wrap(*points["sampler"], "sampler + wait for GPU")
    if "replay" in points:
        wrap(*points["replay"], "copy + replay launch", events=True)
    def reset() -> None:
        torch.cuda.synchronize()
        host.clear()
        spans.clear()

    try:
        wall = decode_step_ms(llm, batch, input_len, steps, before_timing=reset)
    finally:
        for (obj, name), original in originals.items():
            if original is None:
                delattr(obj, name)  # the instance attribute shadowed the method
            else:
                setattr(obj, name, original)
    torch.cuda.synchronize()
    out = {"wall_ms": wall}
    out.update({key: secs / steps * 1e3 for key, secs in host.items()})
    out["other host"] = wall - sum(out[k] for k in host)
    if spans:
        gpu = sorted(s.elapsed_time(e) for s, e in spans)
        out["replay_gpu_ms"] = gpu[len(gpu) // 2]
    return out


def async_decode_step_ms(llm: LLM, batch: int, input_len: int, steps: int) -> dict[str, float]:
    """``decode_step_ms`` with async scheduling off and on, on the same loaded model: with it on the host
    schedules and launches step N+1 while the device runs step N, so the step's wall time should come
    down to its GPU time (compare with ``decode_step_breakdown``'s replay_gpu_ms)."""
    core = llm.engine.core
    was_on, out = core.stepper is not None, {}
    try:
        for on in (False, True):
            set_async_scheduling(core, on)
            out["async_ms" if on else "sync_ms"] = decode_step_ms(llm, batch, input_len, steps)
    finally:
        set_async_scheduling(core, was_on)
    return out


def replay_ms(llm: LLM, max_len: int | None = None, reps: int = 50) -> float | None:
    """GPU time of one bare decode-graph replay (CUDA events): the step minus all host work.

    Replays the bucket of the latest step, with that step's inputs still in the static buffers (it
    rewrites that step's KV slots with the values they already hold); ``max_len`` picks the length
    class (default: the one the step used; any class is exact for contexts up to it)."""
    graphs = decode_graphs(llm.engine.core)
    if graphs is None or graphs.last_replayed is None:
        return None
    bucket, used = graphs.last_replayed
    graph = graphs.graph(bucket, max_len or used)
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def event_ms(fn, reps: int = 10) -> float:
    """GPU ms per ``fn()`` over ``reps`` eager calls after one warm-up call (CUDA events)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def prefill_attention(num_seqs: int, length: int, heads: int, kv_heads: int, head_dim: int,
                      block_size: int = 16, reps: int = 10) -> tuple[float, float, float]:
    """(ms of our registered prefill attention, ms of the paged Triton kernel alone, ms of torch SDPA) for
    ``num_seqs`` causal prompts of ``length`` tokens, one layer, bf16. The registered op sends whole long
    prompts to SDPA (kernels/sdpa_prefill.py); the Triton kernel is what prompts with a cached prefix run.
    SDPA (flash) gets contiguous, head-expanded K/V: its best case."""
    import torch.nn.functional as F

    from kvrelay import kernels
    from kvrelay.kernels.triton.prefill_attention import prefill_attention as paged_prefill
    blocks = num_seqs * length // block_size
    kv = torch.randn(2, blocks, block_size, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(num_seqs * length, heads, head_dim, device="cuda", dtype=torch.bfloat16)  # [T, H, D]
    per_seq = length // block_size
    meta = kernels.AttentionMetadata(
        slot_mapping=torch.arange(num_seqs * length, device="cuda"),
        query_start_loc=torch.arange(0, num_seqs * length + 1, length, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((num_seqs,), length, dtype=torch.int32, device="cuda"),
        block_tables=torch.arange(blocks, dtype=torch.int32, device="cuda").view(num_seqs, per_seq),
        query_start_loc_cpu=list(range(0, num_seqs * length + 1, length)), seq_lens_cpu=[length] * num_seqs,
        max_query_len=length, max_seq_len=length,
    )
    qs = q.view(num_seqs, length, heads, head_dim).transpose(1, 2)  # [S, H, L, D]
    ks, vs = (kv[i].view(num_seqs, length, kv_heads, head_dim).transpose(1, 2)
              .repeat_interleave(heads // kv_heads, dim=1).contiguous() for i in (0, 1))

    # the model passes this step's k/v beside the cache (kernels.rotary_write_kv's outputs), so do we
    k_new, v_new = (kv[i].reshape(num_seqs * length, kv_heads, head_dim) for i in (0, 1))
    fns = [lambda: kernels.paged_attention(q, kv, meta, head_dim ** -0.5, k=k_new, v=v_new),
           lambda: paged_prefill(q, kv, meta, head_dim ** -0.5, None, k_new, v_new),
           lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)]
    # in turns, best round of each: a GPU whose clocks move (after a long decode run, say) shifts all three
    # alike instead of whichever ran first
    rounds = [[event_ms(fn, reps) for fn in fns] for _ in range(5)]
    ours, triton_only, sdpa = (min(r[i] for r in rounds) for i in range(3))
    return ours, triton_only, sdpa


def generate_seconds(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    if cached:  # a prompt seen before (a warm-up's) would be timed at the prefix cache's speed, not the prefill's
        raise RuntimeError(f"{cached} prompt tokens came from the prefix cache: time prompts not run before")
    return elapsed


def prefill_tok_s(llm: LLM, count: int, length: int, vocab: int, seed: int, runs: int = 2) -> tuple[float, list[float]]:
    """The best of ``runs`` timings of ``count`` fresh prompts of ``length`` tokens (one output token each),
    and every run's tok/s: a first run has paid for what the warm-up did not reach (a kernel compiled for a new
    shape, the allocator growing) and has measured at half speed."""
    rates = [count * length / generate_seconds(llm, random_prompts(count, length, vocab, seed + i), 1)
             for i in range(runs)]
    return max(rates), rates


# -- HF transformers baseline -------------------------------------------------------------------------
def hf_model(hf_config: dict):
    """HF's model of the same config, random init (its own N(0, initializer_range)), bf16, built on the GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**hf_config)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.to("cuda").eval()


@torch.inference_mode()
def hf_decode_step_ms(model, batch: int, input_len: int, short: int = 4, long: int = 20) -> float:
    """ms per generated token of HF ``generate`` at ``batch``: the difference of two generation lengths,
    so the prefill cancels out (min_new_tokens keeps EOS from ending it early)."""
    vocab = model.config.vocab_size
    ids = torch.tensor(random_prompts(batch, input_len, vocab, seed=1), device="cuda")

    def run(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                       min_new_tokens=n, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(2)  # warm-up
    return (run(long) - run(short)) / (long - short) * 1e3


@torch.inference_mode()
def hf_prefill_tok_s(model, prompts: int, length: int, per_call: int = 2) -> float:
    """Prompt tokens per second of HF forward passes (``per_call`` prompts each, last logits only)."""
    vocab = model.config.vocab_size
    ids = torch.tensor(random_prompts(per_call, length, vocab, seed=2), device="cuda")
    model(input_ids=ids, use_cache=False, logits_to_keep=1)  # warm-up
    torch.cuda.synchronize()
    calls = max(1, prompts // per_call)
    t0 = time.perf_counter()
    for _ in range(calls):
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    torch.cuda.synchronize()
    return calls * per_call * length / (time.perf_counter() - t0)
