"""Packing paged KV blocks into raw frames and unpacking them into another cache (the portable,
host-staged handoff path; ZMQ sends the frames zero-copy).

One frame per layer, so a later pipelined sender can ship layer ``l`` while layer ``l+1`` computes.
A frame is ``kv_cache[layer][:, block_ids]`` made contiguous: ``[2, n_blocks, block_size, Hkv, D]``.
The receiver trusts nothing: layout, dtype, frame sizes and the checksum are all checked before a
single byte lands in its cache.
"""

import warnings

import torch

from shared.protocol import kv_checksum

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def layout_of(kv_cache: torch.Tensor) -> dict:
    # kv_cache: [L, 2, N, bs, Hkv, D]
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    return dict(num_layers=num_layers, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                dtype=DTYPE_NAMES[kv_cache.dtype])


def pack_blocks(kv_cache: torch.Tensor, block_ids: list[int]) -> list[memoryview]:
    """Copy the blocks out (host memory), one frame per layer; the caller may free the blocks after."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    frames = []
    for layer in range(kv_cache.shape[0]):
        blocks = kv_cache[layer].index_select(1, index).to("cpu").contiguous()  # [2, n, bs, Hkv, D]
        frames.append(memoryview(blocks.view(torch.uint8).numpy()).cast("B"))
    return frames


def frame_nbytes(kv_cache: torch.Tensor, num_blocks: int) -> int:
    _, two, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    return two * num_blocks * block_size * num_kv_heads * head_dim * kv_cache.element_size()


def check_frames(kv_cache: torch.Tensor, header, frames: list) -> None:
    """Raise ValueError unless ``frames`` are exactly what ``header`` promised and fit this cache."""
    mine = layout_of(kv_cache)
    theirs = dict(num_layers=header.num_layers, block_size=header.block_size, num_kv_heads=header.num_kv_heads,
                  head_dim=header.head_dim, dtype=header.dtype)
    if mine != theirs:
        diff = {k: (theirs[k], mine[k]) for k in mine if mine[k] != theirs[k]}
        raise ValueError(f"KV layout mismatch (sent, expected): {diff}")
    if header.num_frames != mine["num_layers"] or len(frames) != header.num_frames:
        raise ValueError(f"expected {mine['num_layers']} frames, header says {header.num_frames}, got {len(frames)}")
    size = frame_nbytes(kv_cache, header.num_blocks)
    sizes = [memoryview(f).nbytes for f in frames]
    if any(s != size for s in sizes) or sum(sizes) != header.nbytes:
        raise ValueError(f"KV frame sizes {sizes[:3]}... do not match {size} bytes per layer / {header.nbytes} total")
    if kv_checksum(frames) != header.checksum:
        raise ValueError("KV checksum mismatch")
    if any(not 0 <= b < kv_cache.shape[2] for b in header.block_ids):
        raise ValueError("KV destination block id out of range")


def unpack_blocks(kv_cache: torch.Tensor, block_ids: list[int], frames: list) -> None:
    """Write checked frames into ``block_ids`` of this cache."""
    shape = (2, len(block_ids)) + tuple(kv_cache.shape[3:])
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    for layer, frame in enumerate(frames):
        with warnings.catch_warnings():  # read-only receive buffers: we only ever read from them
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(memoryview(frame), dtype=torch.uint8)
        blocks = data.view(kv_cache.dtype).view(shape)
        kv_cache[layer].index_copy_(1, index, blocks.to(kv_cache.device))
