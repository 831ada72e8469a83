"""What benchmarks measure of the engine's insides (bench/engine_step.py, bench/scheduler.py, bench/gpu*.py),
kept here so that nothing outside the engine names its scheduler, block manager or runner.

``phase_points`` names where a step's phases run, for a benchmark to wrap with timers; the other helpers
switch or read what a GPU benchmark compares (CUDA graphs against eager, async scheduling on and off, the
model's shape)."""

import time

from kvrelay.shared.config.engine import SchedulerConfig
from kvrelay.shared.engine.block_manager import BlockManager
from kvrelay.shared.engine.cuda_graphs import DecodeGraphs
from kvrelay.shared.engine.engine_core import EngineCore
from kvrelay.shared.engine.request import Request
from kvrelay.shared.engine.scheduler import Scheduler
from kvrelay.shared.wire.sampling_params import SamplingParams


def phase_points(core: EngineCore) -> dict[str, tuple[object, str]]:
    """Phase name -> (object, attribute) of the callable that runs it; "replay" only when decode is
    graph-captured. "execute" contains "build inputs", "sampler" and "replay", "pieces" (a step with prompt tokens
    under FULL_AND_PIECEWISE) or "forward" (the eager model forward of any other step)."""
    runner, sched = core.runner, core.scheduler
    points = {"schedule": (sched, "schedule"), "update": (sched, "update_from_output"),
              "execute": (runner, "execute"), "build inputs": (runner, "_build"), "sampler": (runner, "sampler"),
              "forward": (runner, "_forward")}
    if runner.graphs is not None:
        points["replay"] = (runner.graphs, "run")
    if runner.piecewise is not None:  # the forward of a step with prompt tokens under FULL_AND_PIECEWISE
        points["pieces"] = (runner.piecewise, "run")
    return points


def on_cuda(core: EngineCore) -> bool:
    """Whether the engine runs on a CUDA device (a benchmark times the GPU's tail there)."""
    return core.runner.device.type == "cuda"


def set_piecewise(core: EngineCore, on: bool) -> bool:
    """Run steps with prompt tokens through the captured pieces (True) or eagerly (False) from the next step on;
    False when there are no pieces (not captured: CPU, a model they do not cover, another cudagraph mode)."""
    core.runner.piecewise_on = on
    return core.runner.piecewise is not None


def decode_graphs(core: EngineCore) -> DecodeGraphs | None:
    """The captured decode graphs (None: not captured, e.g. on CPU or with enforce_eager)."""
    return core.runner.graphs


def set_eager(core: EngineCore, eager: bool) -> None:
    """Run decode steps eagerly (True) or through the captured graphs (False) from the next step on."""
    core.runner.enforce_eager = eager


def set_async_scheduling(core: EngineCore, on: bool) -> None:
    """Step with async scheduling (True) or synchronously (False) from the next step on. Only between
    runs: with every request finished, a step still in flight holds none whose token is wanted."""
    if core.has_unfinished():
        raise RuntimeError("switch async scheduling between runs, with no request unfinished")
    core.stepper = core.new_stepper() if on else None


def set_pipeline_batch_queue(core: EngineCore, on: bool) -> None:
    """Step a pipeline with its batch queue (True, shared/engine/batch_queue.py) or draining every step
    (False) from the next step on; only between runs, when no micro-batch is in flight."""
    if core.has_unfinished():
        raise RuntimeError("switch the pipeline batch queue between runs, with no request unfinished")
    core.config.pipeline_batch_queue = on
    core.stepper = core.new_stepper() if on else None
    if not on and core.runner.ranks is not None:
        core.runner.ranks.before_other = None


def set_token_budget(core: EngineCore, tokens: int) -> None:
    """Schedule at most ``tokens`` per step from the next step on (``max_num_batched_tokens``); benchmarks
    compare budgets on one loaded model."""
    core.scheduler.max_num_batched_tokens = tokens


def model_shape(core: EngineCore) -> dict[str, int]:
    """Layers, heads and head size of the model, and the bytes of its embedding table (a decode step reads
    only the rows of its tokens)."""
    model = core.runner.model
    embed = model.model.embed_tokens.weight
    return {"num_layers": model.num_layers, "num_heads": model.num_heads, "num_kv_heads": model.num_kv_heads,
            "head_dim": model.head_dim, "embed_bytes": embed.numel() * embed.element_size()}


def schedule_cost(batch: int, prompt_len: int, steps: int, block_size: int = 16) -> list[tuple[int, float]]:
    """The real Scheduler and BlockManager (prefix caching on), no model, through decode steps of ``batch``
    requests whose contexts grow from ``prompt_len`` tokens, one fake sampled token per request per step:
    (context length, mean seconds of schedule() + update_from_output() per step) at four points."""
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
