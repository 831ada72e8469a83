"""The CPU engine's attention (kernels/cpu_attention.py) against the torch reference it replaces on
CPU, on the paged cases the Triton kernels are checked with: shuffled blocks, a block-major pool
view, tables padded past each sequence, GQA."""

import pytest
import torch

from kvrelay.kernels import cpu_attention, reference
from tests.kernels.triton_cases import alibi_slopes, assert_close, make_paged_case


def _step_kv(kv_cache: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor]:
    # this step's k/v are the cache entries at its slots: what the model passes after write_kv
    page = kv_cache.shape[2]
    block, offset = meta.slot_mapping // page, meta.slot_mapping % page
    return kv_cache[0, block, offset].clone(), kv_cache[1, block, offset].clone()


def _check(q_lens, seq_lens, heads=(6, 2), page=4, alibi=False, dtype=torch.float32):
    q, kv_cache, meta = make_paged_case(q_lens, seq_lens, heads[0], heads[1], 16, page, dtype, "cpu")
    k, v = _step_kv(kv_cache, meta)
    slopes = alibi_slopes(heads[0], "cpu") if alibi else None
    got = cpu_attention.paged_attention(q, kv_cache, meta, 0.25, slopes, k=k, v=v)
    want = reference.paged_attention(q.float(), kv_cache.float(), meta, 0.25, slopes)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("page", [1, 4, 16])
def test_decode(heads, page):
    _check([1] * 5, [1, 7, 16, 33, 64], heads, page)


def test_prefill_without_prefix():
    _check([5, 16, 1, 30], [5, 16, 1, 30])


def test_chunks_extending_a_prefix_mixed_with_decodes():
    _check([3, 1, 16, 1], [20, 9, 16, 40])


@pytest.mark.parametrize("decode", [True, False])
def test_alibi(decode):
    _check([1, 1] if decode else [4, 9], [6, 13] if decode else [4, 12], alibi=True)


def test_bf16():
    _check([1] * 4, [3, 17, 8, 40], dtype=torch.bfloat16)
    _check([7, 12], [7, 12], dtype=torch.bfloat16)
