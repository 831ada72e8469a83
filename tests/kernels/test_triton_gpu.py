"""Triton kernels vs kernels/reference.py on CUDA at realistic shapes (``pytest -m gpu tests/kernels``).

The same checks run at small shapes on CPU through the interpreter in test_interpret.py.
"""

import pytest
import torch

from tests.kernels import triton_cases as cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DEV = "cuda"


@pytest.fixture(scope="module")
def tk():
    pytest.importorskip("triton")
    import kvrelay.kernels.triton as tk  # imported here, not at collection, so CPU runs never build it

    return tk


def _ragged(n: int, low: int, high: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (n,), generator=gen).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode(tk, dtype, head_dim, page, group):
    seq_lens = _ragged(7, 1, 3000, seed=head_dim + page + group) + [1]
    cases.check_paged_attention(tk, DEV, [1] * 8, seq_lens, 4 * group, 4, head_dim, page, dtype, seed=group)


@pytest.mark.parametrize("num_splits", [None, 3, 64])
def test_decode_long_context_split_k(tk, num_splits):
    # Llama-3-8B heads; 32k + ragged others: the heuristic splits, and forced odd/large split counts
    cases.check_paged_attention(tk, DEV, [1] * 4, [32768, 20001, 1, 777], 32, 8, 128, 16, torch.bfloat16, num_splits=num_splits)


# Each case compiles its own prefill kernel (head dim and page are compile-time constants; the GQA group sizes
# the tile's rows). bf16 runs the whole head_dim x page x group grid. fp16, the same code in the other
# half-precision type, runs an all-pairs subset: every (head_dim, page), (head_dim, group) and (page, group) pair
# at least once. fp32, the slowest to compile, runs every (page, group) pair, head_dim 128 in two of them (all
# pairs but head_dim 128 with group 8, which the fp32 cases before this subset lacked too).
_ALL_PAIRS = [(64, 16, 1), (128, 32, 1), (128, 16, 4), (64, 32, 4), (64, 16, 8), (128, 32, 8)]
_FP32_CASES = [(64, 16, 1), (128, 32, 1), (128, 16, 4), (64, 32, 4), (64, 16, 8), (64, 32, 8)]
PREFILL_CASES = ([(torch.bfloat16, h, p, g) for h in (64, 128) for p in (16, 32) for g in (1, 4, 8)]
                 + [(torch.float16, *case) for case in _ALL_PAIRS] + [(torch.float32, *case) for case in _FP32_CASES])


@pytest.mark.parametrize("dtype, head_dim, page, group", PREFILL_CASES)
def test_prefill(tk, dtype, head_dim, page, group):
    # full prefills, chunked prefill over cached prefixes, and decode rows in one mixed batch
    q_lens = [300, 129, 1, 64, 1000, 1]
    seq_lens = [300, 1500, 2047, 864, 1000, 1]
    cases.check_paged_attention(tk, DEV, q_lens, seq_lens, 4 * group, 4, head_dim, page, dtype, seed=head_dim + group)


@pytest.mark.parametrize("config", [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 2)])
def test_prefill_tilings(tk, config):
    # the tilings bench/kernels_bench.py sweeps; Llama-3-8B heads, long prompts with and without a prefix
    cases.check_paged_attention(tk, DEV, [1000, 700, 1, 257], [1000, 2000, 900, 300], 32, 8, 128, 16,
                                torch.bfloat16, seed=config[1], configs=[config])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lens", [[1500, 1500, 1100], [1024, 1024, 2048], [2048, 2048]],
                         ids=["padded", "exact-views-and-one-more", "the-whole-step-on-views"])
def test_whole_prompts_through_sdpa(tk, dtype, lens):
    # whole prompts, long enough per call: the registered op takes torch's SDPA (kernels/sdpa_prefill.py)
    cases.check_paged_attention(tk, DEV, lens, lens, 32, 8, 128, 16, dtype)


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("head_dim", [96, 128])
def test_alibi_and_head_dims(tk, decode, head_dim):
    q_lens, seq_lens = ([1] * 3, [2000, 5, 700]) if decode else ([250, 3, 1], [900, 3, 70])
    cases.check_paged_attention(tk, DEV, q_lens, seq_lens, 16, 2, head_dim, 16, torch.float16, alibi=True)


def test_dispatch_through_kernels(tk):
    from kvrelay import kernels
    tk.register_all()
    q, kv_cache, meta = cases.make_paged_case([1, 1], [100, 40], 8, 2, 64, 16, torch.bfloat16, DEV)
    out = kernels.paged_attention(q, kv_cache, meta, 0.125)
    torch.testing.assert_close(out, tk.paged_attention(q, kv_cache, meta, 0.125))


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("head_dim,page", [(128, 16), (64, 32)])
def test_write_kv(tk, dtype, cache_dtype, head_dim, page):
    cases.check_write_kv(tk, DEV, 777, 8, head_dim, page, dtype, cache_dtype)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("head_dim,page", [(128, 16), (64, 32)])
def test_rotary_write_kv(tk, dtype, cache_dtype, head_dim, page):
    cases.check_rotary_write_kv(tk, DEV, 777, 32, 8, head_dim, page, dtype, cache_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens, num_splits", [([1, 37, 4000, 129, 64], None), ([3000], None), ([900, 5, 2], 8)])
def test_rotary_decode_attention(tk, dtype, seq_lens, num_splits):
    cases.check_rotary_decode_attention(tk, DEV, seq_lens, 32, 8, 128, 128, 16, dtype, num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [4096, 1000])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(tk, dtype, hidden, residual):
    cases.check_rms_norm(tk, DEV, 300, hidden, dtype, residual)


@pytest.mark.parametrize("op", ["linear", "norm", "add_norm", "silu_mul"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3])
def test_skinny_linear(tk, op, dtype, rows):
    # one fp16/bf16 row takes the fused kernel (K > 8192 its other blocking); fp32 and more rows compose
    cases.check_skinny_linear(tk, DEV, rows, 1000, 9000 if op == "silu_mul" else 4100, dtype, op, bias=op != "norm")


def test_rms_norm_fp32_weight(tk):
    cases.check_rms_norm(tk, DEV, 64, 2048, torch.bfloat16, True, weight_dtype=torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_layer_norm(tk, dtype, bias):
    cases.check_layer_norm(tk, DEV, 300, 768, dtype, bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rot_dim", [(128, 128), (64, 64), (80, 32)])
def test_rotary(tk, dtype, head_dim, rot_dim):
    cases.check_rotary(tk, DEV, 500, 32, 8, head_dim, rot_dim, dtype, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [14336, 1000])
def test_silu_mul(tk, dtype, inter):
    cases.check_silu_mul(tk, DEV, 257, inter, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu(tk, dtype, approximate):
    cases.check_gelu(tk, DEV, 3072 * 101, dtype, approximate)


def test_sampling(tk):
    cases.check_sampling(tk, DEV, 64, 32000)


def test_sampling_with_logit_bias(tk):
    cases.check_sampling_with_logit_bias(tk, DEV, 64, 32000)

