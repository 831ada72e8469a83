"""``--calculate-kv-scales``: an fp8 KV cache's per-layer K/V scales measured on one calibration batch as the
engine starts, then fixed for the cache's life (shared/engine/kv_dtype.py says why they must be fixed).

As in vLLM, one batch of tokens that are not a user's sets them: each layer's scales are the amax of the keys
(after rotary, as the cache stores them) and of the values its forward is about to write, over
``K_SCALE_RANGE`` / ``V_SCALE_RANGE`` (kv_dtype.py), measured before that layer's first write is quantized.
Which batch is a choice, made so that:
- The scales do not depend on whichever prompt comes first: the batch is fixed (pseudo-random token ids from a
  fixed seed, ``calibration_prompt``), so every process that runs it through the same weights, on the same kind
  of device and dtype, measures the same scales. That is what a disaggregated pair needs: the decode worker reads
  the prefill worker's blocks with its own scales, and both measured them on the same batch. Nothing else is
  agreed: the digest of the scales in every handoff ask (shared/engine/kv_scales.py) still refuses blocks from a
  worker that measured others (another device kind, another dtype, another ``--max-model-len`` short enough to
  cut the batch, no ``--calculate-kv-scales``), before any byte moves, instead of misreading them.
- The scales do not depend on ``--max-num-batched-tokens``: the batch runs in one step even where the budget is
  smaller (``calibrate_in_one_step``). A batch cut to the budget would give every budget scales of its own, and
  with them other fp8 values for every K/V and other logprobs for the same prompt; split across steps, its first
  step would set each layer's scales before the later tokens were seen. One step of at most
  ``CALIBRATION_TOKENS``, once at start, is small beside the steps a budget exists for, and a GPU's KV profile
  counts it (kv_cache.py).
- No request ever writes a block under a scale that changes afterwards: the batch runs inside the engine's
  construction, before any request can arrive, and before warm-up.
- CUDA graphs need nothing of their own: the decode graphs, captured as the runner starts, read each layer's
  scales through its tensor (kernels/triton/write_kv.py ``scale_arg``), which the measurement updates in place
  (``measure_kv_scale``), and the measuring forward is a prefill, which always runs eagerly (its host-side
  check of the result syncs, which a capture could not).
The batch runs as an ordinary request through the scheduler and the block manager, so its KV lands in blocks
the engine lends it (a pool shared with other models included) and is freed after, with the prefix cache reset.
"""

import logging
import math
from contextlib import contextmanager

import torch

from kvrelay.shared.engine.kv_scales import scales_digest
from kvrelay.shared.wire.sampling_params import SamplingParams

log = logging.getLogger(__name__)

CALIBRATION_TOKENS = 256  # at most; fewer when --max-model-len holds fewer
CALIBRATION_SEED = 0
CALIBRATION_REQUEST = "kvrelay-kv-scales"
CALIBRATION_TENANT = "kvrelay-kv-scales"  # its own, as warm-up's: no user tenant's fairness counters see its tokens


def calibration_prompt(vocab_size: int, num_tokens: int) -> list[int]:
    """The calibration batch's token ids: the same on every process for the same vocabulary and length."""
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    return torch.randint(0, vocab_size, (num_tokens,), generator=generator).tolist()


def calibration_length(max_model_len: int) -> int:
    """Tokens of the calibration prompt: one step runs all of them, so every layer measures the whole batch;
    the prompt leaves room for the one token it samples."""
    return min(CALIBRATION_TOKENS, max_model_len - 1)


@contextmanager
def calibrate_in_one_step(scheduler, num_tokens: int):
    """The scheduler's token budget raised to ``num_tokens`` while the calibration batch runs, so the whole
    batch is one step whatever ``--max-num-batched-tokens`` is; nothing else runs then (the engine is still
    being built), and the budget is back as it was before the first request."""
    budget = scheduler.max_num_batched_tokens
    scheduler.max_num_batched_tokens = max(budget, num_tokens)
    try:
        yield
    finally:
        scheduler.max_num_batched_tokens = budget


def calculate_kv_scales(core) -> list[list[float]]:
    """Measure ``core``'s fp8 KV scales on the calibration batch and make them the cache's: each layer's
    ``kv_scale``, the runner's table and the digest its handoff asks carry. Returns them, [layer][K, V]."""
    runner = core.runner
    attns = [next(m for m in layer.modules() if hasattr(m, "kv_scale")) for _, layer in runner.model.held_layers()]
    bm = core.block_manager
    counters = bm.prefix_queries, bm.prefix_hits
    prompt = calibration_prompt(core.vocab_size, calibration_length(core.max_model_len))
    for attn in attns:
        attn.kv_scale_pending = True
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        core.add_request(core.make_request(CALIBRATION_REQUEST, prompt, params, tenant=CALIBRATION_TENANT))
        with calibrate_in_one_step(core.scheduler, len(prompt)):
            while core.has_unfinished():
                core.step()
        core.scheduler.release_held(CALIBRATION_REQUEST)  # a prefill worker's core holds it for a handoff
        bm.reset_prefix_cache()
        bm.prefix_queries, bm.prefix_hits = counters
        if missed := [i for i, attn in enumerate(attns) if attn.kv_scale_pending]:
            raise RuntimeError(f"--calculate-kv-scales: the calibration batch did not reach layers {missed}")
    finally:
        for attn in attns:
            attn.kv_scale_pending = False
    scales = runner.kv_scales.tolist()
    bad = [i for i, row in enumerate(scales) if not all(math.isfinite(s) and s > 0 for s in row)]
    if bad:
        raise ValueError(f"--calculate-kv-scales: layer {bad[0]}'s keys or values on the calibration batch are not "
                         f"finite (scales {scales[bad[0]]}): the model overflows in {runner.dtype}")
    if runner.kv_scale_table:
        log.info("--calculate-kv-scales: the measured KV scales replace the %d layers' the checkpoint carries",
                 len(runner.kv_scale_table))
    runner.kv_scale_table = scales
    runner.kv_scales_digest = core.kv.scales_digest = scales_digest(scales, runner.model.num_layers)
    log.info("fp8 KV cache scales measured on %d calibration tokens: K %.4g..%.4g, V %.4g..%.4g", len(prompt),
             min(s[0] for s in scales), max(s[0] for s in scales), min(s[1] for s in scales),
             max(s[1] for s in scales))
    return scales
