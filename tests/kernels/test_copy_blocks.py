"""The KV block copy kernel (kernels/triton/copy_blocks.py) against its torch reference and plain
indexing: on CPU through Triton's interpreter (``TRITON_INTERPRET=1``), and at Llama-3-8B's KV shape
on CUDA (``pytest -m gpu``)."""

import os

import pytest
import torch

from kvrelay.kernels import reference
from kvrelay.shared.handoff.blocks import kv_strides

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CUDA = torch.cuda.is_available()
interpret = pytest.mark.skipif(CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                               reason="CUDA present: the gpu tests below cover the kernel")


@pytest.fixture(scope="module")
def kernel():
    triton = pytest.importorskip("triton")
    if not CUDA:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(triton.language.standard.zeros, InterpretedFunction):
            pytest.skip("triton was imported before TRITON_INTERPRET=1: run with it in the environment")
    from kvrelay.kernels.triton.copy_blocks import copy_blocks

    return copy_blocks


def cache(layers: int, blocks: int, block_size: int, heads: int, head_dim: int, dtype: torch.dtype,
          block_major: bool, device: str, seed: int = 0) -> torch.Tensor:
    """Random KV ``[L, 2, N, bs, Hkv, D]``, layer-major or a block-major view (as a KV pool's), whose
    storage starts past some padding so the view's offset is not zero."""
    shape = [layers, 2, blocks, block_size, heads, head_dim]
    gen = torch.Generator(device).manual_seed(seed)
    pad = block_size * heads * head_dim  # one row: word-aligned, as a pool's per-model region is
    flat = torch.randn(pad + torch.Size(shape).numel(), generator=gen, device=device).to(dtype)
    return flat.as_strided(shape, kv_strides(shape, block_major), pad)


def check(copy, device: str, dtype: torch.dtype, src_major: bool, dst_major: bool, layers: range,
          src_ids: list[int], dst_ids: list[int], shape=(4, 4, 2, 16), src_blocks=40, dst_blocks=24) -> None:
    num_layers, block_size, heads, head_dim = shape
    src = cache(num_layers, src_blocks, block_size, heads, head_dim, dtype, src_major, device, seed=1)
    dst = cache(num_layers, dst_blocks, block_size, heads, head_dim, dtype, dst_major, device, seed=2)
    expected, want = dst.clone(), dst.clone()
    si, di = (torch.tensor(ids, dtype=torch.int32, device=device) for ids in (src_ids, dst_ids))
    copy(src, si, dst, di, layers)
    reference.copy_blocks(src, si, expected, di, layers)
    want[layers.start:layers.stop, :, dst_ids] = src[layers.start:layers.stop, :, src_ids]
    assert torch.equal(want, expected), "the reference is not plain indexing"
    assert torch.equal(dst, expected)  # copied rows, and nothing else in dst touched


SCATTERED = (list(range(0, 40, 3)), list(range(23, 9, -1)))  # 14 unordered pairs, neither side consecutive
LAYOUTS = [(False, False), (True, True), (True, False), (False, True)]  # layer- / block-major src, dst


@interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("src_major,dst_major", LAYOUTS)
def test_copy_blocks_both_layouts_and_dtypes(kernel, dtype, src_major, dst_major):
    check(kernel, "cpu", dtype, src_major, dst_major, range(4), *SCATTERED)


@interpret
@pytest.mark.parametrize("layers", [range(0, 1), range(1, 3), range(3, 4), range(2, 2)])
def test_copy_blocks_layer_subrange(kernel, layers):
    check(kernel, "cpu", torch.bfloat16, True, False, layers, *SCATTERED)


@interpret
def test_copy_blocks_repeated_and_unordered_source_ids(kernel):
    # one source block to several destinations (a shared prefix), destinations in any order
    check(kernel, "cpu", torch.float16, False, True, range(4), [5, 5, 39, 0, 5, 17], [20, 3, 0, 23, 11, 7])


@interpret
@pytest.mark.parametrize("shape", [(2, 4, 2, 16), (2, 2, 1, 3), (2, 3, 3, 5), (2, 64, 4, 32)])
def test_copy_blocks_odd_rows_and_multi_tile_rows(kernel, shape):
    # rows of 3 or 45 fp16 (no 8- or 4-byte words: moved as they are), and 8192 fp16 = 2 tiles of int64
    check(kernel, "cpu", torch.float16, False, True, range(2), [1, 7, 3], [0, 2, 1], shape=shape,
          src_blocks=8, dst_blocks=4)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("src_major,dst_major", LAYOUTS)
def test_copy_blocks_gpu_llama_shape(kernel, dtype, src_major, dst_major):
    # Llama-3-8B's KV rows (8 heads of 128, 16-token blocks), 300 scattered pairs, N differing
    gen = torch.Generator().manual_seed(0)
    src_ids = torch.randperm(400, generator=gen)[:300].tolist()
    dst_ids = torch.randperm(320, generator=gen)[:300].tolist()
    for layers in (range(32), range(5, 12)):
        check(kernel, "cuda", dtype, src_major, dst_major, layers, src_ids, dst_ids, shape=(32, 16, 8, 128),
              src_blocks=400, dst_blocks=320)
