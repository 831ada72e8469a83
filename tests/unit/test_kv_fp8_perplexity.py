"""Accuracy of the fp8 KV cache on real weights: SmolLM2-135M on the fixed text the weight-quantization
perplexity test reads (its ``perplexity`` helper, tests/unit/test_quant_perplexity.py), KV stored as
float8_e4m3fn against the default (the model's dtype) in the same run, at scale 1.0 and with the scales
--calculate-kv-scales measures (shared/engine/kv_calibration.py). Bound (issue 27): <= +2% for both.

The prompt is prefilled in chunks of 64 tokens, so most of its attention reads earlier chunks back from
the fp8 cache (and each chunk's own keys are rounded through fp8 as they are stored), as decode does."""

from tests.unit.test_quant_perplexity import perplexity

BOUND = 0.02


def test_fp8_kv_cache_perplexity(smollm2_dir):
    chunked = dict(max_num_batched_tokens=64)
    base, ids = perplexity(smollm2_dir, **chunked)
    fp8, _ = perplexity(smollm2_dir, ids, kv_cache_dtype="fp8", **chunked)
    measured, _ = perplexity(smollm2_dir, ids, kv_cache_dtype="fp8", calculate_kv_scales=True, **chunked)
    assert 5 < base < 50, (base, fp8)  # a real model on real text, not noise
    print(f"perplexity: default KV {base:.4f}, fp8 KV {fp8:.4f} ({fp8 / base - 1:+.2%}), fp8 KV with measured "
          f"scales {measured:.4f} ({measured / base - 1:+.2%})")
    assert fp8 <= base * (1 + BOUND), (base, fp8)
    assert measured <= base * (1 + BOUND), (base, measured)
    assert fp8 != base, (base, fp8)  # the KV really was stored as fp8
    assert measured != fp8, (fp8, measured)  # under other scales than 1.0
