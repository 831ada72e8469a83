"""The fp8 KV cache on a GPU (``pytest -m gpu tests/gpu/test_fp8_kv_gpu.py``): the Triton KV write, rotary
write, decode (split-K and not), prefill/mixed, fused rotary decode kernels at Llama-3-8B head shapes read
the float8 cache directly against attention over the cache dequantized first (tests/kernels/fp8_kv_cases.py,
which tests/kernels/test_fp8_kv_interpret.py runs at small shapes on CPU); long whole prompts (SDPA with the
step's k/v rounded through fp8) against the same reference; and whole models: twice the blocks from the same
memory, and logprobs through CUDA-graph and eager decode matching HF transformers with a cache that rounds
K/V through fp8 (tests/unit/test_kv_fp8_models.py's reference)."""

import pytest
import torch

from kvrelay import LLM, SamplingParams
from kvrelay.kernels import reference
from tests.conftest import random_prompts
from tests.kernels import fp8_kv_cases as cases
from tests.kernels.triton_cases import assert_close, fresh_kv, make_paged_case

# Triton's float8_e4m3fn conversions need compute capability 8.9 (Ada, Hopper) or later
FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not FP8_GPU, reason="needs CUDA with compute capability >= 8.9")]
DEV = "cuda"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]  # float32: the models the equality tests run


@pytest.fixture(scope="module")
def tk():
    pytest.importorskip("triton")
    import kvrelay.kernels.triton as tk  # imported here, not at collection, so CPU runs never build it

    return tk


@pytest.mark.parametrize("dtype", DTYPES)  # float32 is in DTYPES: listing it twice ran the same case twice
def test_write_kv(tk, dtype):
    cases.check_write_kv(tk, DEV, 777, 8, 128, 16, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_write_kv(tk, dtype):
    cases.check_rotary_write_kv(tk, DEV, 777, 32, 8, 128, 16, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [None, 8])
def test_decode_attention(tk, dtype, num_splits):
    seq_lens = [1, 17, 300, 2048, 4100, 64, 999, 8192]
    cases.check_paged_attention(tk, DEV, [1] * len(seq_lens), seq_lens, 32, 8, 128, 16, dtype, num_splits=num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_and_mixed_attention(tk, dtype):
    # whole prompts, chunks over a cached prefix, and decode rows in one batch
    cases.check_paged_attention(tk, DEV, [300, 1, 512, 77, 1], [300, 2000, 1536, 77, 5000], 32, 8, 128, 16, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_decode_attention(tk, dtype):
    cases.check_rotary_decode_attention(tk, DEV, [5, 300, 2048, 4099], 32, 8, 128, 16, dtype)


# half precision only: fp32 never takes SDPA, and its fp8-cache prefill is test_prefill_and_mixed_attention's
# (each fp32 case compiles the Triton prefill kernel for over a minute: the longest tests of the GPU suite)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_long_whole_prompts_through_sdpa_see_the_stored_values(tk, dtype):
    """Prompts of >= 1024 tokens with no cached prefix take torch's SDPA on the step's own k/v: those are
    rounded through fp8 first, so the result is attention over what the cache holds."""
    q, bf_cache, meta = make_paged_case([1500, 2048], [1500, 2048], 32, 8, 128, 16, dtype, DEV, seed=9)
    scale = cases.kv_scale(DEV)
    cache = cases.fp8_cache_like(bf_cache, scale)
    k, v = fresh_kv(bf_cache, meta)
    out = tk.paged_attention(q, cache, meta, 128 ** -0.5, k=k, v=v, kv_scale=scale)
    expected = reference.paged_attention(q.float(), cases.dequantized(cache, scale), meta, 128 ** -0.5)
    assert_close(out, expected, dtype)


def test_same_memory_holds_twice_the_blocks_on_the_gpu():
    # eager: the block count comes from the fixed KV memory alone, and capturing 2 x 23 decode graphs (the default
    # 256 sequences) told nothing about it
    kw = dict(model="dummy:tiny-llama", dtype="bfloat16", kv_cache_memory=64 << 20, max_model_len=512, device=DEV,
              enforce_eager=True)
    bf16, fp8 = LLM(**kw).engine.core, LLM(kv_cache_dtype="fp8", **kw).engine.core
    assert fp8.kv_dtype == torch.float8_e4m3fn and fp8.num_total_blocks == 2 * bf16.num_total_blocks


@pytest.mark.parametrize("arch,eager", [("llama", False), ("llama", True), ("gpt2", False), ("bloom", False)])
def test_fp8_kv_on_the_gpu_matches_the_rounded_reference(tiny_model_dirs, arch, eager):
    """Decode through captured CUDA graphs (and eagerly, for llama) over the fp8 cache."""
    from tests.unit.test_kv_fp8_models import SEPARATION, _logprobs, _reference

    model_dir = str(tiny_model_dirs[arch])
    prompts = random_prompts(6, lo=20, hi=60, seed=3)
    # 6 prompts: at most 8 sequences captures the buckets of 1 to 8, all a step of these can replay
    llm = LLM(model=model_dir, dtype="float32", kv_cache_dtype="fp8", num_gpu_blocks=256, max_model_len=128,
              max_num_batched_tokens=16, max_num_seqs=8, enforce_eager=eager, device=DEV)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    graphs = llm.engine.core.runner.graphs
    assert (graphs is None) == eager and (eager or graphs.num_replays > 0)
    worst_rounded = worst_plain = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        ids = prompt + out.outputs[0].token_ids
        rounded, plain = _reference(model_dir, ids, round_kv=True), _reference(model_dir, ids, round_kv=False)
        for pos, tok, lp in _logprobs(prompt, out):
            worst_rounded = max(worst_rounded, abs(lp - rounded[pos, tok].item()))
            worst_plain = max(worst_plain, abs(lp - plain[pos, tok].item()))
    # GPU fp32 sums in another order than the CPU reference: a last-bit difference may move one K/V element
    # to the neighbouring fp8 value, so the bound is looser than the CPU test's, still far below SEPARATION
    assert worst_rounded <= 2e-2 and worst_plain >= SEPARATION, (worst_rounded, worst_plain)
