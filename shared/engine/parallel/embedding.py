"""Vocab-parallel embedding and LM head: each rank holds ceil(V / N) rows of the vocabulary.

Lookup: a rank embeds the ids in its range and zeros elsewhere; an all-reduce sums the one non-zero row
per token. Logits: each rank multiplies by its rows, an all-gather concatenates the slices in rank
order, and the padding rows (the last rank's, when N does not divide V) are cut off. GPT-2's 50257
tokens are why the vocabulary is padded rather than required to divide.
"""

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.shared.engine.parallel.state import ParallelState


def vocab_range(vocab: int, rank: int, world: int) -> tuple[int, int, int]:
    """(first id, real rows, rows per rank) of rank's slice of the vocabulary."""
    per_rank = -(-vocab // world)
    start = min(rank * per_rank, vocab)
    return start, min(per_rank, vocab - start), per_rank


def vocab_rows(t: torch.Tensor, vocab: int, rank: int, world: int) -> torch.Tensor:
    """Rank's rows of a [vocab, hidden] checkpoint tensor, zero-padded to rows-per-rank."""
    start, count, per_rank = vocab_range(vocab, rank, world)
    rows = t.narrow(0, start, count)
    if count == per_rank:
        return rows
    return torch.cat([rows, rows.new_zeros(per_rank - count, *rows.shape[1:])])


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, parallel: ParallelState) -> None:
        super().__init__()
        self.parallel = parallel
        self.start, self.count, per_rank = vocab_range(vocab, parallel.rank, parallel.world_size)
        self.weight = nn.Parameter(torch.empty(per_rank, hidden, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.count)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.parallel.all_reduce(x)


def parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, parallel: ParallelState,
                    vocab: int) -> torch.Tensor:
    """[T, vocab] fp32 logits, on every rank, from each rank's [rows per rank, hidden] slice."""
    local = F.linear(hidden, weight)  # [T, rows per rank]
    return parallel.all_gather(local)[:, :vocab].float()
