"""The Triton kernels at small shapes on CPU tensors through Triton's interpreter (CI has no GPU).

Run: ``TRITON_INTERPRET=1 python -m pytest tests/kernels/test_interpret.py -q``. Without the variable it
still runs when nothing imported triton before tests/kernels/conftest.py set it. On a CUDA machine the
module skips, since the GPU tests cover the same checks, unless TRITON_INTERPRET=1 is already set.
The kernels are called directly, not through the ``kernels.*`` dispatcher, which would pick the
reference on CPU.
"""

import pytest
import torch

from tests.kernels.interpreted import interpret_triton_kernels

interpret_triton_kernels("tests/kernels/test_triton_gpu.py")
import kvrelay.kernels.triton as tk  # noqa: E402
from kvrelay.kernels.triton.decode_attention import FP32_BLOCK_N_CANDIDATES  # noqa: E402
from kvrelay.kernels.triton.prefill_attention import FP32_CANDIDATES  # noqa: E402
from tests.kernels import triton_cases as cases  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEV = "cpu"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("page", [8, 16])
def test_decode_attention(dtype, group, page):
    cases.check_paged_attention(tk, DEV, [1] * 4, [1, 37, 130, 64], 8, 8 // group, 32, page, dtype, seed=group + page)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_decode_split_k(num_splits):
    # 8 splits over 5 tokens leaves empty splits, which the merge must weigh as nothing
    cases.check_paged_attention(tk, DEV, [1] * 3, [200, 5, 129], 8, 2, 32, 16, torch.float32, num_splits=num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("page", [8, 16])
def test_prefill_attention(dtype, group, page):
    # plain prefill, chunked prefill over a cached prefix, and decode rows in one mixed batch
    cases.check_paged_attention(tk, DEV, [5, 1, 40, 17], [5, 70, 100, 17], 8, 8 // group, 32, page, dtype, seed=group)


def test_prefill_tilings():
    # key tiles wider than a page and than the diagonal, small query tiles: every loop of the kernel
    # (prefix, prefix tail, unmasked and diagonal fresh tiles) runs at several (M, N)
    cases.check_paged_attention(tk, DEV, [70, 1, 33], [70, 90, 140], 4, 2, 32, 8, torch.float32,
                                configs=[(16, 32, 4, 2), (32, 16, 4, 2), (16, 64, 4, 2)])


@pytest.mark.parametrize("config", FP32_CANDIDATES, ids=str)
def test_prefill_fp32_candidate_tilings(config):
    # each tiling bench/triton_fp32_compile.py times, any of which may become FP32_CONFIG: GQA rows, a prefix
    # with a ragged end, the causal diagonal, a decode row
    cases.check_paged_attention(tk, DEV, [70, 1, 33], [70, 90, 140], 8, 2, 32, 8, torch.float32, configs=[config])


@pytest.mark.parametrize("block_n", FP32_BLOCK_N_CANDIDATES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_fp32_candidate_block_n(block_n, num_splits):
    # the decode key tiles the same bench times, over one split and several (a ragged last tile in each)
    cases.check_paged_attention(tk, DEV, [1] * 4, [200, 5, 129, 1], 8, 2, 32, 8, torch.float32,
                                num_splits=num_splits, block_n=block_n)


@pytest.mark.parametrize("decode", [True, False])
def test_attention_alibi_and_odd_head_dim(decode):
    q_lens = [1, 1] if decode else [3, 20]
    cases.check_paged_attention(tk, DEV, q_lens, [50, 90], 4, 2, 40, 8, torch.float32, alibi=True, num_splits=2 if decode else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits, rot_dim", [(None, 32), (4, 32), (3, 16)])
def test_rotary_decode_attention(dtype, num_splits, rot_dim):
    # one split and several (the step's token in the last non-empty one), full and partial rotary
    cases.check_rotary_decode_attention(tk, DEV, [1, 37, 200, 9], 8, 2, 32, rot_dim, 8, dtype, num_splits)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)])
def test_write_kv(dtype, cache_dtype):
    cases.check_write_kv(tk, DEV, 37, 2, 32, 8, dtype, cache_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(dtype, residual):
    cases.check_rms_norm(tk, DEV, 5, 200, dtype, residual)


@pytest.mark.parametrize("op", ["linear", "norm", "add_norm", "silu_mul"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_skinny_linear(op, dtype):
    # one row takes the fused kernel; N and K not multiples of its blocks exercise the masks
    cases.check_skinny_linear(tk, DEV, 1, 40, 1100, dtype, op, bias=op != "norm")


def test_skinny_linear_more_rows_composes():
    cases.check_skinny_linear(tk, DEV, 3, 40, 96, torch.float16, "add_norm", bias=False)


def test_rms_norm_fp32_weight():
    cases.check_rms_norm(tk, DEV, 3, 64, torch.bfloat16, True, weight_dtype=torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_layer_norm(dtype, bias):
    cases.check_layer_norm(tk, DEV, 5, 200, dtype, bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot_dim", [32, 16])
def test_rotary(dtype, rot_dim):
    cases.check_rotary(tk, DEV, 6, 4, 2, 32, rot_dim, dtype, torch.float32)


def test_rotary_bf16_cache():
    cases.check_rotary(tk, DEV, 6, 4, 1, 64, 64, torch.bfloat16, torch.bfloat16)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_rotary_write_kv(dtype, cache_dtype):
    cases.check_rotary_write_kv(tk, DEV, 13, 4, 2, 32, 8, dtype, cache_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    cases.check_silu_mul(tk, DEV, 3, 1100, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.filterwarnings("ignore:overflow encountered")  # numpy's exp(2z) -> inf saturates tanh to 1, as intended
def test_gelu(dtype, approximate):
    cases.check_gelu(tk, DEV, 2100 * 7, dtype, approximate)


def test_sampling():
    cases.check_sampling(tk, DEV, 12, 50)


def test_sampling_with_logit_bias():
    cases.check_sampling_with_logit_bias(tk, DEV, 12, 50)
