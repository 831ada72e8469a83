"""One step through a pipeline: each stage's output goes to the next stage with a torch.distributed
point-to-point send (gloo on CPU, NCCL on CUDA), and the last stage sends rank 0 the logits of exactly the
rows rank 0 samples from (none, the sampled rows, or every row when prompt logprobs follow), which rank
0's sampler then reads as if its own model had formed them. The step's inputs reach every stage the way a
tensor-parallel step's do (broadcast.py); only activations and logits travel here.

One step flows through the stages before the next starts: stages do not overlap yet.
"""

from collections.abc import Callable

import torch

from kvrelay.shared.engine.parallel.state import ParallelState
from kvrelay.shared.engine.step_inputs import StepBatch
from kvrelay.shared.wire.rank_step import LOGITS_ALL, LOGITS_NONE, LOGITS_SAMPLED

# tags keep a stage's activations and the last stage's logits apart on the same pair of ranks
HIDDEN_TAG, LOGITS_TAG = 1, 2


def send_carried(state: ParallelState, carried: tuple[torch.Tensor, ...], peer: int) -> None:
    """This stage's output, to ``peer`` (this rank's counterpart in the next stage)."""
    for t in carried:
        state.group.send([t.contiguous()], peer, HIDDEN_TAG).wait()


def recv_carried(state: ParallelState, model, num_tokens: int, peer: int) -> tuple[torch.Tensor, ...]:
    """The previous stage's output from ``peer``: ``model.carried_tensors`` tensors of [num_tokens, hidden]."""
    dtype = next(model.parameters()).dtype
    out = []
    for _ in range(model.carried_tensors):
        t = torch.empty(num_tokens, model.hidden_size, dtype=dtype, device=state.device)
        state.group.recv([t], peer, HIDDEN_TAG).wait()
        out.append(t)
    return tuple(out)


def send_logits(state: ParallelState, model, hidden: torch.Tensor, sample_rows: torch.Tensor,
                num_sample_rows: int, mode: int, sender: bool) -> None:
    """The last stage: the logits rank 0 asked for (``mode``), formed by every rank of the stage (a
    collective when the stage is tensor-parallel), sent to rank 0 by its ``sender``."""
    if mode == LOGITS_NONE:
        return
    every = num_sample_rows == hidden.shape[0]
    rows = hidden if mode == LOGITS_ALL or every else hidden.index_select(0, sample_rows)
    logits = model.compute_logits(rows)
    if sender:
        state.group.send([logits.contiguous()], 0, LOGITS_TAG).wait()


def recv_logits(state: ParallelState, vocab_size: int, batch: StepBatch, sample_rows: torch.Tensor, mode: int,
                peer: int) -> tuple[torch.Tensor | None, Callable[[int, int], torch.Tensor] | None]:
    """Rank 0: (logits of the sampled rows or None, logits_of(start, count) of prompt-logprob rows or None),
    the same shape of answer ``driver_step.group_logits`` gives."""
    if mode == LOGITS_NONE:
        return None, None
    every = batch.samples_every_row
    rows = batch.num_tokens if mode == LOGITS_ALL or every else len(batch.sample_rows)
    logits = torch.empty(rows, vocab_size, dtype=torch.float32, device=state.device)
    state.group.recv([logits], peer, LOGITS_TAG).wait()
    if mode == LOGITS_SAMPLED:
        return logits, None
    sampled = (logits if every else logits.index_select(0, sample_rows)) if batch.sample_rows else None
    return sampled, lambda start, count: logits[start:start + count]
