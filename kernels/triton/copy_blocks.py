"""Block copy between two paged KV caches: the KV handoff's device copy (shared/handoff/blocks.py).

Both caches are ``[L, 2, N, bs, Hkv, D]`` with any layer / K-V / block strides (layer-major, or a
block-major view of a KV pool) and their own block counts; one (layer, K/V, block) row of
``bs * Hkv * D`` elements is contiguous in both. One launch copies every (block pair, layer plane,
row tile): a copy per block or per run costs a launch each, and a gather then a scatter moves the
bytes twice through a temporary.
"""

import torch
import triton
import triton.language as tl

from kvrelay.kernels.triton.utils import pow2

_TILE_BYTES = 8192  # per program: four 16-byte accesses per thread at 4 warps, ~32k programs for 256 MiB


@triton.jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, first_plane, row,
    src_s_layer, src_s_kv, src_s_block, dst_s_layer, dst_s_kv, dst_s_block,
    TILE: tl.constexpr,
):
    pair = tl.program_id(0)
    plane = first_plane + tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2).to(tl.int64) * TILE + tl.arange(0, TILE)
    s = tl.load(src_ids_ptr + pair).to(tl.int64)
    d = tl.load(dst_ids_ptr + pair).to(tl.int64)
    layer, kv = plane // 2, plane % 2
    mask = offs < row
    x = tl.load(src_ptr + layer * src_s_layer + kv * src_s_kv + s * src_s_block + offs, mask=mask)
    tl.store(dst_ptr + layer * dst_s_layer + kv * dst_s_kv + d * dst_s_block + offs, x, mask=mask)


def copy_blocks(src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor,
                layers: range) -> None:
    """``dst[layers][:, :, dst_ids] = src[layers][:, :, src_ids]`` on the current stream.

    ``src_ids``/``dst_ids``: int32 on the caches' device, in range (the caller checks: reading them
    here would wait for the device); ``dst_ids`` distinct, or which copy lands is unspecified.
    """
    assert src.dtype == dst.dtype and src.shape[:2] == dst.shape[:2] and src.shape[3:] == dst.shape[3:]
    assert src_ids.dtype == dst_ids.dtype == torch.int32 and src_ids.shape == dst_ids.shape
    if len(layers) == 0 or src_ids.numel() == 0:
        return
    src, dst = _words(src, dst)
    row = src[0, 0, 0].numel()
    for t in (src, dst):  # a row must be one contiguous run in both caches
        assert t.stride(5) == 1 and t.stride(4) == t.shape[5] and t.stride(3) == t.shape[4] * t.shape[5]
    tile = min(pow2(row), max(1, _TILE_BYTES // src.element_size()))
    grid = (src_ids.numel(), 2 * len(layers), triton.cdiv(row, tile))
    _copy_blocks_kernel[grid](
        src, dst, src_ids, dst_ids, 2 * layers.start, row,
        src.stride(0), src.stride(1), src.stride(2), dst.stride(0), dst.stride(1), dst.stride(2),
        TILE=tile, num_warps=4,
    )


def _words(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both caches' bytes as the widest words (8, else 4 bytes) that every row, stride and start of
    both allows: a program's cost is per element, so bf16 moved as int64 is 4x fewer for the same bytes."""
    for dtype in (torch.int64, torch.int32):
        size = dtype.itemsize
        if src.element_size() < size and all(_divides(t, size) for t in (src, dst)):
            return src.view(dtype), dst.view(dtype)
    if src.dtype == torch.float8_e4m3fn:  # bytes are bytes: no float8 loads where a row is not 4-byte aligned
        return src.view(torch.uint8), dst.view(torch.uint8)
    return src, dst


def _divides(t: torch.Tensor, size: int) -> bool:
    nbytes = t.element_size()
    return (t.shape[-1] * nbytes % size == 0 and t.storage_offset() * nbytes % size == 0
            and all(s * nbytes % size == 0 for s in t.stride()[:-1]))
