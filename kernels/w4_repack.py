"""The W4 weight repacked once, at load, for kernels/triton/w4_fast.py: what the inner loop would otherwise
redo on every element of every call is done here.

From kernels/quant.py's W4 layout (``qweight`` int32 [K/8, N], nibble j of word row r is input 8r + j;
uint8 zero points and fp16 scales [K/G, N]; optional act-order ``g_idx``):

- act-order resolved: the K rows are sorted by group (``perm``), so every group is ``group_size``
  consecutive rows again and a K tile reads one row of scales; the kernel gathers the activation through
  ``perm`` instead (what vLLM and ExLlama do). A ``g_idx`` that is not a permutation of whole groups is
  refused (``ValueError``): the original layout's kernel still reads it.
- nibbles interleaved per K tile of ``tile_k`` inputs: nibble j of word row r of tile t is input
  ``t * tile_k + j * tile_k / 8 + r``, so shifting a [tile_k/8, N] block of words by 4j yields the j-th
  contiguous slab of the tile, and the eight slabs stacked are the tile in input order.
- zero points and scales stay as they are (uint8 and fp16 [K/G, N]): the kernel folds ``1024 + z``, the
  value a nibble OR'd into the mantissa of 0x6400 (fp16 1024.0) must lose, once per K tile and column, so
  ``w = (bits - (1024 + z)) * scale`` per element with no integer conversion. Stored folded in fp16 they
  would add 3% to the bytes a decode step reads, for work done once per 128 elements.
"""

from dataclasses import dataclass

import torch

from kvrelay.kernels.quant import PACK, unpack_w4, w4_groups

TILE_KS = (128, 64, 32, 16)  # tl.dot needs a K tile of 16 or more; a tile must not straddle two groups


@dataclass(frozen=True)
class W4Packed:
    qweight: torch.Tensor  # int32 [K/8, N], interleaved per tile_k
    scales: torch.Tensor  # fp16 [K/G, N]
    zeros: torch.Tensor  # uint8 [K/G, N]
    perm: torch.Tensor | None  # int32 [K]: row i of the packed weight is input perm[i]; None: in order
    group_size: int
    tile_k: int

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K), as an nn.Linear weight's."""
        return self.qweight.shape[1], self.qweight.shape[0] * PACK


def default_tile_k(group_size: int, k: int) -> int:
    """The largest tile in ``TILE_KS`` that divides both the group size and K."""
    for t in TILE_KS:
        if group_size % t == 0 and k % t == 0:
            return t
    raise ValueError(f"group size {group_size} (K {k}) is not a multiple of 16: the repacked W4 kernel cannot read it")


def _sort_groups(g_idx: torch.Tensor, group_size: int) -> torch.Tensor:
    k = g_idx.numel()
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], torch.arange(k, device=g_idx.device) // group_size):
        raise ValueError(f"g_idx is not a permutation of whole groups of {group_size}: it cannot be sorted into them")
    return perm


def repack_w4(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
              g_idx: torch.Tensor | None = None, tile_k: int | None = None) -> W4Packed:
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    tile_k = tile_k or default_tile_k(group_size, k)
    if group_size % tile_k or k % tile_k or tile_k % 16:
        raise ValueError(f"tile_k {tile_k} must be a multiple of 16 dividing the group size {group_size} and K {k}")
    q = unpack_w4(qweight)  # [K, N]
    perm = None
    if g_idx is not None and not torch.equal(g_idx.long(), w4_groups(k, group_size, None, g_idx.device)):
        perm = _sort_groups(g_idx, group_size)
        q = q[perm]
        perm = perm.to(torch.int32)
    q = q.reshape(k // tile_k, PACK, tile_k // PACK, n)  # [tile, slab j, row r, N]
    words = torch.zeros(k // tile_k, tile_k // PACK, n, dtype=torch.int32, device=q.device)
    for j in range(PACK):
        words |= q[:, j] << (4 * j)  # nibble 7 sets int32's sign bit: the same 32 bits
    return W4Packed(words.reshape(k // PACK, n).contiguous(), scales.half().contiguous(),
                    zeros.to(torch.uint8).contiguous(), perm, group_size, tile_k)


def dequantize_packed(p: W4Packed, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [N, K] weight in input order, read back from the repacked layout alone (the layout's test)."""
    n, k = p.shape
    words = p.qweight.reshape(k // p.tile_k, 1, p.tile_k // PACK, n)
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)[None, :, None, None]
    q = ((words >> shifts) & 0xF).reshape(k, n).float()  # packed row order
    g = torch.arange(k, device=q.device) // p.group_size
    w = (q - p.zeros[g].float()) * p.scales[g].float()
    if p.perm is not None:
        w = torch.empty_like(w).index_copy_(0, p.perm.long(), w)
    return w.t().to(dtype)
