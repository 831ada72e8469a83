"""Rank 0's half of a tensor-parallel step (shard_runner.py is the other ranks' half): the message that
announces the step's inputs, and the logits, formed in one collective every rank joins, for exactly the
rows rank 0 needs: none (a mid-prompt chunk), the sampled rows, or every row (prompt logprobs follow).

Async scheduling (shared/engine/async_step.py) keeps the ids rank 0 sampled at step N on its device and
launches step N+1 before its host reads them. The ranks need those ids too (every rank of the first stage
embeds the step's input ids), so they travel as the rest of the step does, minus the host: the message
counts the fed rows (``num_fed``) and the frame lists them after the packed inputs (both known on the host
before step N ends), then rank 0 broadcasts the rows' ids from its device (NCCL on CUDA: queued behind step
N's sampling on the stream, no host sync; gloo on the CPU, where everything is host memory anyway). A
pipeline's broadcasts go out once every micro-batch's message has, before any stage runs (pipe_driver.py).
No host waits on step N's ids: rank 0 queues step N+1 on every rank first and reads them after. What does not
overlap: a rank other than 0 copies its frame to its device from pageable memory, a copy CUDA may hold until
that device's queued work (its part of step N) is done, as in synchronous stepping; and a pipeline still
drains every step, since the first stage of step N+1 needs step N's ids (filling the stages across steps
needs step N+1's rows to be other requests': the batch queue, shared/engine/batch_queue.py). On the CPU
(gloo) nothing overlaps, as with one process.
"""

from collections.abc import Callable

import torch

from kvrelay.shared.engine.step_inputs import Layout, StepBatch
from kvrelay.shared.wire.rank_step import LOGITS_ALL, LOGITS_NONE, LOGITS_SAMPLED, RankStep


def logits_mode(samples: bool, every_row: bool) -> int:
    return LOGITS_ALL if every_row else LOGITS_SAMPLED if samples else LOGITS_NONE


def step_message(batch: StepBatch, layout: Layout, mode: int, num_fed: int = 0, micro_batches: int = 1) -> RankStep:
    return RankStep(batch.num_tokens, batch.num_seqs, layout.width, len(batch.sample_rows), batch.max_query_len,
                    max(batch.seq_lens), mode, micro_batches, num_fed)


def step_frame(host: torch.Tensor, fed_rows: list[int]) -> memoryview:
    """The frame after a ``RankStep``: the packed inputs (``host``), then the rows whose ids are fed."""
    if fed_rows:
        host = torch.cat((host, torch.tensor(fed_rows, dtype=torch.int32)))
    return memoryview(host.numpy())


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
