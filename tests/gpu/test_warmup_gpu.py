"""Warm-up on a GPU: after it, traffic of new shapes compiles no Triton kernel variant and captures no
CUDA graph. Each case runs in a fresh process, so that kernels compiled by other tests (Triton's
in-memory caches are per process) neither hide a gap nor count against it. The workload mixes prompt
lengths from 1 to the context, staggered arrivals (so prefill mixes with decodes at every batch size),
chunked prompts, prefix-cache hits and every sampler path.

``pytest -m gpu tests/gpu/test_warmup_gpu.py`` on a CUDA machine; skips without CUDA.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

MAX_LEN = {"tiny-llama": 512, "smollm2-135m": 2048}  # tiny-llama's positions end at 512
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def compiled_variants() -> dict[str, int]:
    """Compiled specialisations per Triton kernel of ours, in this process."""
    import importlib
    import pkgutil

    import triton

    import kvrelay.kernels.triton as pkg

    counts: dict[str, int] = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for name, fn in vars(module).items():
            if isinstance(fn, triton.runtime.jit.JITFunction):
                # Triton >= 3.0: device -> (kernel cache, ...); older: device -> kernel cache
                caches = fn.device_caches if hasattr(fn, "device_caches") else {d: (c,) for d, c in fn.cache.items()}
                counts[f"{info.name}.{name}"] = sum(len(c[0]) for c in caches.values())
    return counts


def probe(preset: str, eager: bool, device: str = "cuda", mode: str = "FULL_DECODE_ONLY") -> None:
    """Runs in the child: warm up, then serve the workload; prints what each phase compiled/captured."""
    import dataclasses
    import random

    from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from kvrelay.shared.engine.engine_core import EngineCore
    from kvrelay.shared.engine.warmup import warm_up
    from kvrelay.shared.wire.sampling_params import SamplingParams

    config = EngineConfig(
        model=ModelConfig(model=f"dummy:{preset}", load_format="dummy", dtype="bfloat16", max_model_len=MAX_LEN[preset],
                          enforce_eager=eager, cudagraph_mode=mode),
        cache=CacheConfig(num_gpu_blocks=4096),
        scheduler=SchedulerConfig(max_num_seqs=48, max_num_batched_tokens=512), device=device)
    core = EngineCore(config)
    graphs, pieces = core.runner.graphs, core.runner.piecewise
    assert (pieces is not None) == (mode == "FULL_AND_PIECEWISE")
    before = compiled_variants()
    shapes = warm_up(core)
    warmed = compiled_variants()
    captured = (0 if graphs is None else len(graphs._graphs)) + (0 if pieces is None else len(pieces._graphs))
    replayed = 0 if pieces is None else pieces.num_replays

    rng = random.Random(0)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.8),
              SamplingParams(temperature=1.0, top_k=5, seed=3), SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=0.9, repetition_penalty=1.2, min_p=0.1),
              SamplingParams(temperature=0.0, prompt_logprobs=2)]
    shared_prefix = [rng.randrange(core.vocab_size) for _ in range(300)]
    sent = 0
    while sent < 160 or core.has_unfinished():
        for _ in range(rng.choice((0, 0, 1, 1, 2, 5)) if sent < 160 else 0):
            n = rng.choice((1, 2, 5, 17, 31, 64, 100, 255, 256, 257, 600, 1500, rng.randrange(1, 1900)))
            prompt = [rng.randrange(core.vocab_size) for _ in range(n)]
            if rng.random() < 0.2:
                prompt = shared_prefix + prompt
            prompt = prompt[:core.max_model_len - 61]
            p = rng.choice(params)
            p = dataclasses.replace(p, max_tokens=rng.randrange(1, 60), ignore_eos=True)
            core.add_request(core.make_request(f"r{sent}", prompt, p))
            sent += 1
        core.step()
    after = compiled_variants()
    print(json.dumps({
        "shapes": shapes, "warmup_compiled": sum(warmed.values()) - sum(before.values()),
        "new_after_warmup": {k: after[k] - warmed.get(k, 0) for k in after if after[k] != warmed.get(k, 0)},
        "graphs_at_warmup": captured,
        "graphs_after": (0 if graphs is None else len(graphs._graphs)) + (0 if pieces is None else len(pieces._graphs)),
        "piecewise_replays_serving": 0 if pieces is None else pieces.num_replays - replayed,
    }))


# piecewise on the tiny model only: its attention calls are the eager path's own (same kernels, same
# shapes), so what it adds to check is the pieces' capture before warm-up ends, which one preset shows
CASES = [(preset, eager, "NONE" if eager else "FULL_DECODE_ONLY") for preset in ("tiny-llama", "smollm2-135m")
         for eager in (False, True)]
CASES.append(("tiny-llama", False, "FULL_AND_PIECEWISE"))


@pytest.mark.parametrize("preset, eager, mode", CASES, ids=[
    f"{p}-{'piecewise' if m == 'FULL_AND_PIECEWISE' else 'eager' if e else 'graphs'}" for p, e, m in CASES])
def test_nothing_compiles_or_captures_after_warmup(preset, eager, mode):
    # the checkout goes last on sys.path (the children of the suite run under PYTHONSAFEPATH: tests/conftest.py)
    code = (f"import sys; sys.path.append({str(Path(__file__).resolve().parents[2])!r}); "
            f"from tests.gpu.test_warmup_gpu import probe; probe({preset!r}, {eager}, mode={mode!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(result)
    assert result["warmup_compiled"] > 0, "warm-up compiled nothing: it cannot have covered anything"
    assert result["new_after_warmup"] == {}, f"compiled while serving, after warm-up: {result}"
    assert result["graphs_after"] == result["graphs_at_warmup"]
    if mode == "FULL_AND_PIECEWISE":  # the served steps with prompt tokens really took the pieces
        assert result["piecewise_replays_serving"] > 0
