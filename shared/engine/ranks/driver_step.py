"""Rank 0's half of a tensor-parallel step (shard_runner.py is the other ranks' half): the message that
announces the step's inputs, and the logits, formed in one collective every rank joins, for exactly the
rows rank 0 needs: none (a mid-prompt chunk), the sampled rows, or every row (prompt logprobs follow)."""

from collections.abc import Callable

import torch

from kvrelay.shared.engine.step_inputs import Layout, StepBatch
from kvrelay.shared.wire.rank_step import LOGITS_ALL, LOGITS_NONE, LOGITS_SAMPLED, RankStep


def logits_mode(samples: bool, every_row: bool) -> int:
    return LOGITS_ALL if every_row else LOGITS_SAMPLED if samples else LOGITS_NONE


def step_message(batch: StepBatch, layout: Layout, mode: int) -> RankStep:
    return RankStep(batch.num_tokens, batch.num_seqs, layout.width, len(batch.sample_rows), batch.max_query_len,
                    max(batch.seq_lens), mode)


def group_logits(model, hidden: torch.Tensor, batch: StepBatch, sample_rows: torch.Tensor, mode: int
                 ) -> tuple[torch.Tensor | None, Callable[[int, int], torch.Tensor] | None]:
    """(logits of the sampled rows or None, logits_of(start, count) of prompt-logprob rows or None)."""
    if mode == LOGITS_NONE:
        return None, None
    every = batch.samples_every_row
    rows = hidden if mode == LOGITS_ALL or every else hidden.index_select(0, sample_rows)
    logits = model.compute_logits(rows)
    if mode == LOGITS_SAMPLED:
        return logits, None
    sampled = (logits if every else logits.index_select(0, sample_rows)) if batch.sample_rows else None
    return sampled, lambda start, count: logits[start:start + count]
