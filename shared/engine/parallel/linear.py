"""Shard math of the parallel projections: which slice of a full checkpoint tensor one rank holds.

Column-parallel projections (q/k/v, gate/up, fc-in) split their outputs: a rank holds a contiguous block
of output rows, so its activations are its own heads or its own slice of the intermediate size. Row-
parallel projections (o, down, fc-out) split their inputs to match, produce partial sums that one
all-reduce adds up, and carry their bias on rank 0 only so the sum adds it once. Fused projections are
sliced part by part: q, k and v (or gate and up) each give the rank its own heads (rows), then stack.

Every function takes the full checkpoint tensor (a Linear's [out, in] layout) and returns this rank's
part; the loader applies them as the tensor arrives, so no rank keeps a full copy.
"""

import torch


def even(size: int, rank: int, world: int, what: str = "size") -> tuple[int, int]:
    """(start, count) of rank's equal share of ``size``; raises when it does not divide."""
    if size % world:
        raise ValueError(f"tensor_parallel_size {world} does not divide {what} {size}")
    count = size // world
    return rank * count, count


def kv_heads(num_kv_heads: int, rank: int, world: int) -> tuple[int, int]:
    """(first, count) of the KV heads rank holds: an equal share, or, with fewer KV heads than ranks, the
    one KV head its query heads read (replicated on world / num_kv_heads ranks)."""
    if num_kv_heads >= world:
        return even(num_kv_heads, rank, world, "the KV heads")
    if world % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {world} is neither a divisor nor a multiple of the "
                         f"{num_kv_heads} KV heads")
    return rank * num_kv_heads // world, 1


def column(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rows (outputs) of a column-parallel weight or its bias."""
    start, count = even(t.shape[0], rank, world, "the projection's outputs")
    return t.narrow(0, start, count)


def row(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Columns (inputs) of a row-parallel weight."""
    start, count = even(t.shape[1], rank, world, "the projection's inputs")
    return t.narrow(1, start, count)


def row_bias(t: torch.Tensor, rank: int) -> torch.Tensor:
    """A row-parallel bias: added once, by rank 0, to the sum the all-reduce forms."""
    return t if rank == 0 else torch.zeros_like(t)


def heads(t: torch.Tensor, num_heads: int, first: int, count: int) -> torch.Tensor:
    """Rows of heads first..first+count of a [num_heads * head_dim, ...] tensor."""
    head_dim = t.shape[0] // num_heads
    return t.narrow(0, first * head_dim, count * head_dim)


def stacked_qkv(t: torch.Tensor, num_heads: int, rank: int, world: int) -> torch.Tensor:
    """A fused [q | k | v] tensor (each num_heads heads, GPT-2's c_attn): rank's heads of each part,
    stacked again as [q | k | v]."""
    first, count = even(num_heads, rank, world, "the attention heads")
    return torch.cat([heads(part, num_heads, first, count) for part in t.chunk(3, dim=0)], dim=0)


def interleaved_qkv(t: torch.Tensor, num_heads: int, rank: int, world: int) -> torch.Tensor:
    """A per-head interleaved qkv tensor ([H, 3, D, ...] flattened, BLOOM's): rank's heads, still
    interleaved, so the model's own regrouping applies to the slice as to the full tensor."""
    first, count = even(num_heads, rank, world, "the attention heads")
    return heads(t, num_heads, first, count)
