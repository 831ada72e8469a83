"""``--kv-cache-dtype fp8`` with real processes: a disaggregated pair (prefill -> fp8 blocks over the ZMQ
handoff -> decode) gives the tokens of a unified worker with the same fp8 cache, both served by one
gateway and driven by the ``openai`` SDK; a prefill worker whose KV is fp8 handing off to a decode
worker whose KV is not, or is fp8 under another checkpoint's KV scales, gets the decode worker's refusal,
which names the mismatch, and misreads nothing. With ``--calculate-kv-scales`` each process measures its scales
on the same calibration batch: a pair that both measure agree and hand off; a pair where one does not is refused.

fp8 rounding can turn a last-bit fp32 difference (batch shapes differ between the two paths) into a
~1e-3 logit change, so two runs may part at a near tie: tokens must agree up to the first position
where they differ, and there the unified run's top two must be within TIE nats of each other."""


import openai
import pytest

from tests.conftest import random_prompts
from tests.e2e.cluster import Cluster
from tests.kv_scale_checkpoint import self_attn_scales, with_kv_scales

pytestmark = pytest.mark.slow
ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "8", "--max-num-batched-tokens", "32"]
TIE = 0.05
# A prefill worker keeps asking the decode workers that refused it, in case one that takes its KV registers, until
# its handoff budget ends; the refusal's reason is its request's error then. A short budget for the refusal tests:
# the reason is what they check, not how long the prefill worker keeps asking.
REFUSED_WITHIN = ["--handoff-timeout", "3"]


@pytest.fixture()
def cluster(tiny_dir, redis_url, tmp_path):
    c = Cluster(redis_url, str(tiny_dir), ENGINE, tmp_path)
    c.redis.flushall()
    c.start_gateway()
    yield c
    c.stop()


def _complete(c: Cluster, model: str, prompt: list[int]):
    client = openai.OpenAI(base_url=c.base_url, api_key="none", max_retries=0, timeout=120)
    return client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0.0, logprobs=2).choices[0]


@pytest.mark.parametrize(("flags", "logged", "prompts"), [
    ([], "float8_e4m3fn", random_prompts(8, lo=5, hi=90, seed=11)),  # each logged its KV cache as fp8
    # both sides measure their scales on the same calibration batch (min(256, 255), whatever the 32-token budget),
    # so they agree
    (["--calculate-kv-scales"], "fp8 KV cache scales measured on 255 calibration tokens",
     random_prompts(4, lo=5, hi=90, seed=12)),
], ids=["checkpoint-scales", "calculated-scales"])
def test_disaggregated_fp8_gives_the_unified_fp8_tokens(cluster, flags, logged, prompts):
    fp8 = ["--kv-cache-dtype", "fp8", *flags]
    cluster.start_worker("prefill", "p1", ["--served-model-name", "split", *fp8])
    cluster.start_worker("decode", "d1", ["--served-model-name", "split", *fp8])
    cluster.start_worker("unified", "u1", ["--served-model-name", "whole", *fp8])
    cluster.wait_ready()
    for prompt in prompts:
        split, whole = _complete(cluster, "split", prompt), _complete(cluster, "whole", prompt)
        a, b = split.logprobs.tokens, whole.logprobs.tokens
        assert len(a) == len(b), (prompt, a, b)
        i = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if i is not None:  # only at a near tie of the unified run
            top = sorted(whole.logprobs.top_logprobs[i].values(), reverse=True)
            assert top[0] - top[1] < TIE, (prompt, i, a, b)
    for worker in ("p1", "d1", "u1"):
        assert logged in cluster.log(worker)


def test_a_kv_dtype_mismatch_across_the_handoff_is_refused(cluster):
    cluster.start_worker("prefill", "p1", ["--served-model-name", "tiny", "--kv-cache-dtype", "fp8", *REFUSED_WITHIN])
    cluster.start_worker("decode", "d1", ["--served-model-name", "tiny"])
    cluster.wait_ready()
    with pytest.raises(openai.APIError) as err:
        _complete(cluster, "tiny", [5, 6, 7, 8, 9])
    assert ("KV cache dtype mismatch: the prefill worker's KV is float8_e4m3fn, this decode worker's is float32; "
            "give both the same --kv-cache-dtype") in str(err.value), err.value


def test_fp8_kv_under_another_checkpoints_scales_is_refused(cluster, tiny_dir, tmp_path):
    """The prefill worker loads a copy of the model calibrated with KV scales, the decode worker the model
    without: the same fp8 bytes mean other values on each side."""
    scaled = with_kv_scales(tiny_dir, tmp_path / "scaled", self_attn_scales({0: (0.37, 1.9), 1: (2.3, 0.53)}))
    fp8 = ["--served-model-name", "tiny", "--kv-cache-dtype", "fp8"]
    cluster.start_worker("prefill", "p1", [*fp8, "--model", str(scaled), *REFUSED_WITHIN])
    cluster.start_worker("decode", "d1", fp8)
    cluster.wait_ready()
    with pytest.raises(openai.APIError) as err:
        _complete(cluster, "tiny", [5, 6, 7, 8, 9])
    assert "KV cache scales mismatch: the prefill worker's fp8 KV scales (digest " in str(err.value), err.value
    assert "load the same checkpoint, with the same --calculate-kv-scales, on both" in str(err.value), err.value


def test_measured_scales_against_unit_scales_are_refused(cluster):
    fp8 = ["--served-model-name", "tiny", "--kv-cache-dtype", "fp8"]
    cluster.start_worker("prefill", "p1", [*fp8, "--calculate-kv-scales", *REFUSED_WITHIN])
    cluster.start_worker("decode", "d1", fp8)
    cluster.wait_ready()
    with pytest.raises(openai.APIError) as err:
        _complete(cluster, "tiny", [5, 6, 7, 8, 9])
    assert "KV cache scales mismatch" in str(err.value), err.value
