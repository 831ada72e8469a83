"""One step through a pipeline: each stage's output goes to the next stage with a torch.distributed
point-to-point send (gloo on CPU, NCCL on CUDA), and the last stage sends rank 0 the logits of exactly the
rows rank 0 samples from (none, the sampled rows, or every row when prompt logprobs follow), which rank
0's sampler then reads as if its own model had formed them. The step's inputs reach every stage the way a
tensor-parallel step's do (broadcast.py); only activations and logits travel here.

A step of several requests runs as micro-batches (pipe_driver.py), so stage k works on micro-batch i while
stage k+1 works on micro-batch i-1. Every rank posts a micro-batch's transfers in the same order (all
receives from the previous stage before any send to the next, rank 0 every send before any receive), and
each transfer has its own tag, so no send waits on a receive its peer has not posted yet.
"""

from collections.abc import Callable

import torch

from kvrelay.shared.engine.parallel.state import ParallelState
from kvrelay.shared.engine.step_inputs import StepBatch
from kvrelay.shared.wire.rank_step import LOGITS_ALL, LOGITS_NONE, LOGITS_SAMPLED

_HIDDEN_TAG, _LOGITS_TAG = 1 << 16, 1 << 20


def _hidden_tag(micro_batch: int, index: int) -> int:
    return _HIDDEN_TAG + micro_batch * 8 + index


class Pending:
    """Transfers started and not yet waited for (and the tensors they read or fill, kept alive)."""

    def __init__(self) -> None:
        self.works: list = []
        self.tensors: list[torch.Tensor] = []

    def wait(self) -> tuple[torch.Tensor, ...]:
        for work in self.works:
            work.wait()
        self.works = []
        return tuple(self.tensors)


def send_carried(state: ParallelState, carried: tuple[torch.Tensor, ...], peer: int, micro_batch: int,
                 pending: Pending) -> None:
    """Start sending this stage's output to ``peer`` (this rank's counterpart in the next stage)."""
    for i, t in enumerate(carried):
        t = t.contiguous()
        pending.tensors.append(t)
        pending.works.append(state.group.send([t], peer, _hidden_tag(micro_batch, i)))


def recv_carried(state: ParallelState, model, num_tokens: int, peer: int, micro_batch: int) -> Pending:
    """Start receiving the previous stage's output from ``peer``: ``model.carried_tensors`` tensors of
    [num_tokens, hidden], there once the result's ``wait`` returns."""
    dtype = model.compute_dtype
    pending = Pending()
    for i in range(model.carried_tensors):
        t = torch.empty(num_tokens, model.hidden_size, dtype=dtype, device=state.device)
        pending.tensors.append(t)
        pending.works.append(state.group.recv([t], peer, _hidden_tag(micro_batch, i)))
    return pending


def send_logits(state: ParallelState, model, hidden: torch.Tensor, sample_rows: torch.Tensor,
                num_sample_rows: int, mode: int, sender: bool, micro_batch: int) -> None:
    """The last stage: the logits rank 0 asked for (``mode``), formed by every rank of the stage (a
    collective when the stage is tensor-parallel), sent to rank 0 by its ``sender``."""
    if mode == LOGITS_NONE:
        return
    every = num_sample_rows == hidden.shape[0]
    rows = hidden if mode == LOGITS_ALL or every else hidden.index_select(0, sample_rows)
    logits = model.compute_logits(rows)
    if sender:
        state.group.send([logits.contiguous()], 0, _LOGITS_TAG + micro_batch).wait()


def post_logits(state: ParallelState, vocab_size: int, batch: StepBatch, mode: int, peer: int, micro_batch: int
                ) -> tuple[torch.Tensor, object] | None:
    """Rank 0: start receiving the logits rank 0 asked for (``mode``): (their tensor, the receive to wait
    for), None when it asked for none."""
    if mode == LOGITS_NONE:
        return None
    rows = batch.num_tokens if mode == LOGITS_ALL or batch.samples_every_row else len(batch.sample_rows)
    logits = torch.empty(rows, vocab_size, dtype=torch.float32, device=state.device)
    return logits, state.group.recv([logits], peer, _LOGITS_TAG + micro_batch)


def recv_logits(state: ParallelState, vocab_size: int, batch: StepBatch, sample_rows: torch.Tensor, mode: int,
                peer: int, micro_batch: int) -> tuple[torch.Tensor | None, Callable[[int, int], torch.Tensor] | None]:
    """Rank 0: (logits of the sampled rows or None, logits_of(start, count) of prompt-logprob rows or None),
    the same shape of answer ``driver_step.group_logits`` gives."""
    return logits_answer(post_logits(state, vocab_size, batch, mode, peer, micro_batch), batch, sample_rows, mode)


def logits_answer(posted: tuple[torch.Tensor, object] | None, batch: StepBatch, sample_rows: torch.Tensor, mode: int
                  ) -> tuple[torch.Tensor | None, Callable[[int, int], torch.Tensor] | None]:
    """``recv_logits``'s answer from ``post_logits``' receive, once it is here."""
    if posted is None:
        return None, None
    logits, work = posted
    work.wait()
    every = batch.samples_every_row
    if mode == LOGITS_SAMPLED:
        return logits, None
    sampled = (logits if every else logits.index_select(0, sample_rows)) if batch.sample_rows else None
    return sampled, lambda start, count: logits[start:start + count]
