"""Paged KV blocks as the handoff sees them: the cache layout a transfer must agree on, and block
gathers, scatters and copies that every transport uses.

A cache is ``[L, 2, N, bs, Hkv, D]`` (layer-major, or a block-major view of a KV pool,
shared/engine/kv_pool.py); a layer's bytes in a transfer are its blocks, ``kv_cache[layer][:, block_ids]``
made contiguous: ``[2, n_blocks, bs, Hkv, D]``.
"""

from array import array

import torch

from kvrelay import kernels
from kvrelay.shared.wire.handoff import KVHeader

# an fp8 cache (--kv-cache-dtype fp8) moves as its bytes: its scales are fixed by the same flag on both
# sides (shared/engine/kv_dtype.py), so agreeing on the dtype is agreeing on what the bytes mean
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.float8_e4m3fn: "float8_e4m3fn"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
# up to this many contiguous runs, plain strided copies (a launch per run, no block ids to upload); past
# it, the block copy kernel (one launch). The crossover is an estimate, not a measurement:
# `bench handoff --sections cuda` prints both on one run
_RUNS_AS_SLICES = 8
_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    """One copy stream per device, so handoff copies never queue behind (or block) engine kernels."""
    device = torch.device(device)
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def layout_of(kv_cache: torch.Tensor, num_kv_heads: int | None = None, num_layers: int | None = None) -> dict:
    """The layout a transfer states. ``num_kv_heads`` / ``num_layers``: all of the model's, when this cache
    holds one tensor-parallel rank's heads or one pipeline stage's layers (blocks always travel with every
    layer and every KV head, in checkpoint order)."""
    layers, _, _, block_size, heads, head_dim = kv_cache.shape
    return dict(num_layers=num_layers or layers, block_size=block_size, num_kv_heads=num_kv_heads or heads,
                head_dim=head_dim, dtype=DTYPE_NAMES[kv_cache.dtype])


def frame_nbytes(kv_cache: torch.Tensor, num_blocks: int, num_kv_heads: int | None = None) -> int:
    """Bytes of one layer of ``num_blocks`` blocks (of ``num_kv_heads`` heads, default the cache's)."""
    _, two, _, block_size, heads, head_dim = kv_cache.shape
    return two * num_blocks * block_size * (num_kv_heads or heads) * head_dim * kv_cache.element_size()


def check_layout(kv_cache: torch.Tensor, header: KVHeader, num_kv_heads: int | None = None,
                 num_layers: int | None = None) -> None:
    """Raise ValueError unless ``header`` describes this cache's layout (``num_kv_heads`` / ``num_layers``:
    all of the model's, when the cache holds one rank's share) and blocks that exist here."""
    mine = layout_of(kv_cache, num_kv_heads, num_layers)
    theirs = dict(num_layers=header.num_layers, block_size=header.block_size, num_kv_heads=header.num_kv_heads,
                  head_dim=header.head_dim, dtype=header.dtype)
    if mine != theirs:
        diff = {k: (theirs[k], mine[k]) for k in mine if mine[k] != theirs[k]}
        raise ValueError(f"KV layout mismatch (sent, expected): {diff}")
    if not ids_within(header.block_ids, kv_cache.shape[2]):
        raise ValueError("KV destination block id out of range")
    want = header.num_layers * frame_nbytes(kv_cache, header.num_blocks, num_kv_heads)
    if header.nbytes != want:
        raise ValueError(f"KV header promises {header.nbytes} bytes, {header.num_blocks} blocks are {want}")


def ids_within(ids: list[int], n: int) -> bool:
    """Every id in [0, n) (an empty list too): by ``min`` and ``max``, not a Python pass per id."""
    return not ids or 0 <= min(ids) <= max(ids) < n


def gather_blocks(kv_cache: torch.Tensor, layers: range, index: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``kv_cache[layers][:, :, index]`` -> ``[len(layers), 2, n, bs, Hkv, D]``, into ``out`` if given, in
    one call per group of layers: per-call overhead, not bytes, dominated layer-at-a-time copies. On
    CPU through numpy: single-threaded and free of the GIL, where torch's index ops fan out to OpenMP
    and were measured stalling ~30 ms a call when the cores are busy."""
    src = kv_cache[layers.start:layers.stop]
    if out is None:
        out = src.new_empty(src.shape[:2] + (len(index),) + src.shape[3:])
    if src.is_cuda:
        torch.index_select(wide(src), 2, index, out=wide(out))
        return out
    # fancy indexing, not np.take: take first makes a C-contiguous copy of a strided source, which for
    # a pooled (block-major) cache is the whole pool on every transfer
    _block_rows(out)[...] = _block_rows(src)[:, :, index.numpy()]
    return out


def scatter_blocks(kv_cache: torch.Tensor, first: int, index: torch.Tensor, blocks: torch.Tensor) -> None:
    """``kv_cache[first:first + len(blocks)][:, :, index] = blocks`` (numpy on CPU, as ``gather_blocks``)."""
    dst = kv_cache[first:first + blocks.shape[0]]
    if dst.is_cuda:
        wide(dst).index_copy_(2, index, wide(blocks))
        return
    _block_rows(dst)[:, :, index.numpy()] = _block_rows(blocks)


def wide(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as 8-byte elements where the last dimension allows: strided copies and index
    kernels cost per element, so bf16 moved as int64 is 4x fewer elements for the same bytes."""
    if t.element_size() < 8 and t.shape[-1] * t.element_size() % 8 == 0 and t.stride(-1) == 1:
        return t.view(torch.int64)
    return t


def _block_rows(t: torch.Tensor):
    """A CPU ``[layers, 2, n, ...]`` tensor as uint8 block rows: ``[layers, 2, n, block bytes]``. Each
    block is contiguous, its blocks need not be (a pooled cache is block-major); copy=False: scatter
    writes through this view, so a silent copy would lose them."""
    return t.view(torch.uint8).numpy().reshape(t.shape[0], t.shape[1], t.shape[2], -1, copy=False)


def kv_strides(shape: list[int], block_major: bool) -> list[int]:
    """Strides of a dense ``[L, 2, N, bs, Hkv, D]`` cache: layer-major (a plain tensor) or block-major
    (a view of a KV pool: ``[N, L, 2, ...]`` in memory)."""
    order = [2, 0, 1, 3, 4, 5] if block_major else list(range(6))  # dims from outermost to innermost
    strides = [0] * 6
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= shape[d]
    return strides


class BlockCopy:
    """One transfer's blocks from ``src`` to ``dst`` (two caches of one device), planned once and run
    per layer range on the current stream: plain strided copies for a few contiguous runs, else the
    block copy kernel (one launch per range) over id tensors sent to the device once per transfer."""

    def __init__(self, src: torch.Tensor, src_blocks: list[int], dst: torch.Tensor, dst_blocks: list[int]):
        for blocks, kv in ((src_blocks, src), (dst_blocks, dst)):  # the kernel trusts its ids
            if not ids_within(blocks, kv.shape[2]):
                raise ValueError("KV block id out of range")
        self.src, self.dst = src, dst
        self.runs = block_runs(src_blocks, dst_blocks, _RUNS_AS_SLICES)
        self.ids = None
        if self.runs is None:
            # packed by array, not torch.tensor(list): the per-element conversion was most of a plan's cost
            ids = torch.frombuffer(array("i", src_blocks + dst_blocks), dtype=torch.int32).view(2, -1)
            # pinned, so the copy is queued on the stream instead of waiting for the device
            self.ids = ids.pin_memory().to(src.device, non_blocking=True) if src.is_cuda else ids

    def __call__(self, layers: range) -> None:
        if self.ids is None:
            src, dst = wide(self.src), wide(self.dst)
            for s, d, n in self.runs:
                dst[layers.start:layers.stop, :, d:d + n].copy_(src[layers.start:layers.stop, :, s:s + n],
                                                                non_blocking=True)
            return
        if self.ids.is_cuda:  # the ids were queued on the stream current at planning: not freed before use here
            self.ids.record_stream(torch.cuda.current_stream(self.ids.device))
        kernels.copy_blocks(self.src, self.ids[0], self.dst, self.ids[1], layers)


def copy_blocks(src: torch.Tensor, src_blocks: list[int], dst: torch.Tensor, dst_blocks: list[int],
                layers: range | None = None) -> None:
    """``dst[layers][:, dst_blocks] = src[layers][:, src_blocks]`` on the current stream (all layers by
    default), between two caches of one device."""
    BlockCopy(src, src_blocks, dst, dst_blocks)(range(src.shape[0]) if layers is None else layers)


def block_runs(src_blocks: list[int], dst_blocks: list[int],
               limit: int | None = None) -> list[tuple[int, int, int]] | None:
    """(src start, dst start, length) of the maximal runs where both sides are consecutive; None once there
    are more than ``limit`` (a scattered transfer is known as one after ``limit`` + 1 runs, not a whole pass)."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        elif limit is not None and len(runs) == limit:
            return None
        else:
            runs.append((s, d, 1))
    return runs
