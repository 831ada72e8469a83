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
  would add 1.5% to the bytes a decode step reads (groups of 128), for work done once per group and column.

The model's W4Linear interleaves each qweight as it loads (``interleave_w4``; shared/engine/quant/linear.py),
or with act-order sorts and interleaves it (``act_order_perm``, ``sort_and_interleave``) once every weight
has loaded (its ``finish_loading``), g_idx included.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvrelay.kernels.quant import PACK, pack_w4, unpack_w4

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


def tile_k_for(group_size: int, k: int) -> int | None:
    """The largest tile in ``TILE_KS`` that divides both the group size and K; None where none does."""
    return next((t for t in TILE_KS if group_size % t == 0 and k % t == 0), None)


def interleave_w4(qweight: torch.Tensor, tile_k: int) -> torch.Tensor:
    """W4 words in input order [K/8, N] -> the same values interleaved per tile of ``tile_k`` inputs. A cut
    of the inputs on tile boundaries commutes with it (each tile is rearranged on its own)."""
    q = unpack_w4(qweight)
    k, n = q.shape
    q = q.reshape(k // tile_k, PACK, tile_k // PACK, n)  # [tile, slab j, row r, N]
    words = torch.zeros(k // tile_k, tile_k // PACK, n, dtype=torch.int32, device=q.device)
    for j in range(PACK):
        words |= q[:, j] << (4 * j)  # nibble 7 sets int32's sign bit: the same 32 bits
    return words.reshape(k // PACK, n).contiguous()


def act_order_perm(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """int32 [K]: the inputs sorted by group (stable, so the same g_idx gives the same order anywhere);
    None where g_idx is k // G already."""
    k = g_idx.numel()
    in_groups = torch.arange(k, device=g_idx.device) // group_size
    if torch.equal(g_idx.long(), in_groups):
        return None
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], in_groups):
        raise ValueError(f"g_idx is not a permutation of whole groups of {group_size}: it cannot be sorted into them")
    return perm.to(torch.int32)


def repack_w4(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
              g_idx: torch.Tensor | None = None, tile_k: int | None = None) -> W4Packed:
    k = qweight.shape[0] * PACK
    tile_k = tile_k or tile_k_for(group_size, k)
    if tile_k is None or group_size % tile_k or k % tile_k or tile_k % 16:
        raise ValueError(f"the repacked W4 kernel needs a K tile, a multiple of 16, that divides the group size "
                         f"{group_size} and K {k} (tile_k {tile_k})")
    perm = None if g_idx is None else act_order_perm(g_idx, group_size)
    return W4Packed(sort_and_interleave(qweight, perm, tile_k), scales.half().contiguous(),
                    zeros.to(torch.uint8).contiguous(), perm, group_size, tile_k)


def sort_and_interleave(qweight: torch.Tensor, perm: torch.Tensor | None, tile_k: int) -> torch.Tensor:
    """W4 words in input order [K/8, N] -> the packed layout's words: rows in ``perm``'s order (act-order's
    ``act_order_perm``; None: as they are), then interleaved per tile of ``tile_k`` inputs."""
    if perm is not None:
        qweight = pack_w4(unpack_w4(qweight)[perm.long()])
    return interleave_w4(qweight, tile_k)


def dequantize_nibbles(p: W4Packed) -> torch.Tensor:
    """The 4-bit values, int32 [K, N], in the packed layout's row order (act-order's sorted order)."""
    n, k = p.shape
    words = p.qweight.reshape(k // p.tile_k, 1, p.tile_k // PACK, n)
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)[None, :, None, None]
    return ((words >> shifts) & 0xF).reshape(k, n)


def dequantize_packed(p: W4Packed, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [N, K] weight in input order, read back from the repacked layout alone (the layout's test)."""
    k = p.shape[1]
    q = dequantize_nibbles(p).float()
    g = torch.arange(k, device=q.device) // p.group_size
    w = (q - p.zeros[g].float()) * p.scales[g].float()
    if p.perm is not None:
        w = torch.empty_like(w).index_copy_(0, p.perm.long(), w)
    return w.t().to(dtype)


def w4_packed_linear(x: torch.Tensor, p: W4Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: dequantize the repacked weight, then matmul."""
    return F.linear(x, dequantize_packed(p, x.dtype), bias)
