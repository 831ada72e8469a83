"""``--calculate-kv-scales`` on a GPU (``pytest -m gpu tests/gpu/test_calculate_kv_scales_gpu.py``): the decode
CUDA graphs are captured as the runner starts, before the calibration batch measures the scales
(shared/engine/kv_calibration.py); they must read the measured scales, not the 1.0 the scale tensors held at
capture. On a tiny Llama whose K/V are 1000x what e4m3 holds at 1.0 (tests/unit/test_calculate_kv_scales.py),
decode through the graphs meets HF transformers with a cache that rounds K/V through fp8 under the measured
scales, as eager decode does; a graph that read 1.0 would clamp every key and miss it by nats."""

import pytest
import torch

from kvrelay import LLM, SamplingParams
from tests.conftest import random_prompts
from tests.unit.test_calculate_kv_scales import _rescaled
from tests.unit.test_kv_fp8_models import _logprobs, _reference

FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not FP8_GPU, reason="needs CUDA with compute capability >= 8.9")]
# nats. The reference rounds each K/V element to e4m3 under the measured scales; an element near a rounding tie
# lands on either side depending on the order of the fp32 sums that made it, and one flipped element moves by an
# e4m3 step (6% of its value) and every later position that reads it. The GPU sums in another order than the CPU
# reference, so a few flips cost it hundredths of a nat; a graph that read the 1.0 the scale tensors held at
# capture would clamp every key and miss by whole nats.
TOL = 1e-1


def _run(model_dir, prompts, eager: bool, batched: int):
    llm = LLM(model=model_dir, dtype="float32", kv_cache_dtype="fp8", calculate_kv_scales=True, num_gpu_blocks=256,
              max_model_len=128, max_num_batched_tokens=batched, max_num_seqs=16, enforce_eager=eager, device="cuda")
    scales = llm.engine.core.runner.kv_scales.tolist()
    assert all(s > 1.0 for row in scales for s in row), scales  # amax ~4000 over 200 / 100
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, prompt_logprobs=0))
    graphs = llm.engine.core.runner.graphs
    assert (graphs is None) == eager and (eager or graphs.num_replays > 0)
    return scales, outs


# 64-token steps put whole prompts beside decodes; 16-token ones chunk every prompt (as test_fp8_kv_gpu.py's)
@pytest.mark.parametrize("batched", [16, 64])
def test_graph_decode_reads_the_measured_scales(tiny_model_dirs, tmp_path, batched):
    model_dir = str(_rescaled(tiny_model_dirs["llama"], tmp_path / "outsized", 1000.0))
    prompts = random_prompts(6, lo=20, hi=60, seed=3)
    scales, graphed = _run(model_dir, prompts, eager=False, batched=batched)
    eager_scales, eager = _run(model_dir, prompts, eager=True, batched=batched)
    assert eager_scales == scales
    worst = apart = 0.0
    for prompt, out, ref_out in zip(prompts, graphed, eager, strict=True):
        assert out.outputs[0].token_ids == ref_out.outputs[0].token_ids
        ids = prompt + out.outputs[0].token_ids
        rounded = _reference(model_dir, ids, True, dict(enumerate(scales)))
        for (pos, tok, lp), (_, _, eager_lp) in zip(_logprobs(prompt, out), _logprobs(prompt, ref_out), strict=True):
            worst = max(worst, abs(lp - rounded[pos, tok].item()))
            apart = max(apart, abs(lp - eager_lp))
    # the same kernels on the same device read the same cache: graphs and eager agree far inside the flips' noise
    assert apart <= 1e-3, (batched, apart)
    assert worst <= TOL, (batched, worst)
