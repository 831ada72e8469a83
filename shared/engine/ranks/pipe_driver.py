"""Rank 0's half of a pipeline step (shard_runner.py ``_stage_steps`` is the other stages' half): the
scheduled requests are cut into up to one micro-batch per stage, contiguous and about even in tokens.
Every micro-batch's inputs go out to the stages first; then rank 0 runs stage 0 on each in turn, handing
each on without waiting, so stage 1 works on micro-batch 0 while stage 0 works on micro-batch 1; last, rank
0 receives each micro-batch's logits from the last stage. Sampling sees the micro-batches' sampled rows
concatenated, in the scheduler's order. Under async scheduling each micro-batch's fed rows take their ids
from rank 0's device: broadcast to every rank after the last message, before any forward (driver_step.py).

That drains the pipeline every step. The batch queue (shared/engine/batch_queue.py, its lifecycle there)
keeps it full instead: ``launch_micro_batch`` sends one micro-batch of requests not otherwise in flight
through stage 0 and returns; ``land_micro_batch`` takes its logits later, after the queue has launched others."""

import time
from dataclasses import dataclass, field, replace

import torch

from kvrelay.shared.engine.async_step import FedIds
from kvrelay.shared.engine.ranks.driver_step import logits_mode, step_frame, step_message
from kvrelay.shared.engine.ranks.pipe_step import Pending, logits_answer, post_logits, recv_logits, send_carried
from kvrelay.shared.engine.request import Request
from kvrelay.shared.engine.scheduler import ScheduledRequest, SchedulerOutput
from kvrelay.shared.engine.step_inputs import StepBatch, device_inputs, to_host


def split(scheduled: list[ScheduledRequest], count: int) -> list[list[ScheduledRequest]]:
    """``scheduled`` in at most ``count`` contiguous, non-empty parts of about equal token counts."""
    count = max(1, min(count, len(scheduled)))
    total = sum(sr.num_new_tokens for sr in scheduled)
    parts: list[list[ScheduledRequest]] = [[]]
    done = 0
    for i, sr in enumerate(scheduled):
        left_parts = count - len(parts)
        # start the next part once this one holds its share, or when each remaining request needs a part
        if parts[-1] and left_parts > 0 and (done >= total * len(parts) / count
                                              or len(scheduled) - i <= left_parts):
            parts.append([])
        parts[-1].append(sr)
        done += sr.num_new_tokens
    return parts


def _run_stage_0(runner, batch: StepBatch, filled, fill, micro_batch: int, outgoing: Pending) -> torch.Tensor:
    """Stage 0's forward of one micro-batch on rank 0, its output on its way to stage 1; the batch's sample
    rows on the device."""
    t, meta = device_inputs(batch, runner.device, filled, fill)
    hidden = runner.model(t.input_ids, t.positions, runner.kv_cache, meta)
    send_carried(runner.ranks.state, hidden, runner.ranks.layout.next_peer, micro_batch, outgoing)
    return t.sample_rows


def pipeline_step(runner, out: SchedulerOutput, fed: FedIds | None = None
                  ) -> tuple[list[Request], torch.Tensor | None, dict, int]:
    """Run one step of ``runner`` (rank 0's ModelRunner, stage 0) through the pipeline: (the requests that
    sample, in order; their logits [R, V] or None; the step's prompt logprobs by request id; the decode rows
    whose input id came from ``fed``, the previous step's ids on the device, under async scheduling)."""
    ranks, device = runner.ranks, runner.device
    at, state = ranks.layout, ranks.state
    built = []
    parts = split(out.scheduled, at.pp)
    for part in parts:  # every stage gets the whole step before any of them runs
        fills: list[tuple[int, int]] = []
        batch, sample_reqs, prompt_rows = runner._build(replace(out, scheduled=part),
                                                        fed.rows if fed is not None else None, fills)
        filled = to_host(batch, device)
        mode = logits_mode(bool(sample_reqs), bool(prompt_rows))
        ranks.send(step_message(batch, filled[0], mode, len(fills), len(parts)),
                   step_frame(filled[1], [row for row, _ in fills]))
        built.append((batch, sample_reqs, prompt_rows, filled, mode, runner._fed_fill(fills, fed)))
    for *_, fill in built:  # then the fed ids, before any rank runs a forward (driver_step.py)
        if fill is not None:
            state.broadcast_from_driver(fill[1])
    outgoing, rows = Pending(), []
    for i, (batch, _, _, filled, _, fill) in enumerate(built):
        rows.append(_run_stage_0(runner, batch, filled, fill, i, outgoing))
    reqs: list[Request] = []
    logits: list[torch.Tensor] = []
    prompt: dict = {}
    for i, ((batch, sample_reqs, prompt_rows, _, mode, _), sample_rows) in enumerate(zip(built, rows, strict=True)):
        sampled, logits_of = recv_logits(state, runner.model.vocab_size, batch, sample_rows, mode,
                                         at.logits_sender, i)
        if sample_reqs:
            reqs += sample_reqs
            logits.append(sampled)
        prompt.update(runner._prompt_logprobs(prompt_rows, logits_of))
    outgoing.wait()
    num_fed = sum(len(fill[0]) for *_, fill in built if fill is not None)
    return reqs, (torch.cat(logits) if len(logits) > 1 else logits[0] if logits else None), prompt, num_fed


@dataclass
class MicroBatch:
    """One micro-batch of the batch queue (shared/engine/batch_queue.py): launched through stage 0, its
    logits from the last stage taken by ``receive``."""

    out: SchedulerOutput
    batch: StepBatch
    sample_reqs: list[Request]
    prompt_rows: list
    mode: int
    sample_rows: torch.Tensor
    outgoing: Pending
    posted: tuple | None = None  # its logits' receive, once started (pipe_step.py ``post_logits``)
    logits: tuple | None = None  # (sampled rows' logits or None, logits_of or None), once received
    started: float = field(default_factory=time.time)

    def post(self, runner) -> None:
        """Start receiving the logits (once)."""
        if self.posted is None and self.logits is None:
            self.posted = post_logits(runner.ranks.state, runner.model.vocab_size, self.batch, self.mode,
                                      runner.ranks.layout.logits_sender, 0) or ()


def launch_micro_batch(runner, out: SchedulerOutput, in_flight: list[MicroBatch]) -> MicroBatch:
    """Send the stages ``out`` as one micro-batch (a step of its own to them), run stage 0 on it and hand
    it on; returns without waiting for the other stages. No fed ids: a queued micro-batch's requests have
    read every token they sampled. The logits of the micro-batches ``in_flight`` (launched before) are
    received before this one's hidden states are sent: the last stage sends them before it receives this
    one's, and with two stages NCCL orders both directions between ranks 0 and 1 on one stream."""
    batch, sample_reqs, prompt_rows = runner._build(out)
    filled = to_host(batch, runner.device)
    mode = logits_mode(bool(sample_reqs), bool(prompt_rows))
    runner.ranks.send(step_message(batch, filled[0], mode), step_frame(filled[1], []))
    for mb in in_flight:
        mb.post(runner)
    outgoing = Pending()
    rows = _run_stage_0(runner, batch, filled, None, 0, outgoing)
    return MicroBatch(out, batch, sample_reqs, prompt_rows, mode, rows, outgoing)


def receive(runner, mb: MicroBatch) -> None:
    """Wait for ``mb``'s logits from the last stage (once): every stage is done with it then. Micro-batches
    travel one tag, so they must be received in launch order (each pair of ranks keeps its order)."""
    if mb.logits is None:
        mb.post(runner)
        mb.logits = logits_answer(mb.posted or None, mb.batch, mb.sample_rows, mb.mode)
        mb.posted = None
        mb.outgoing.wait()


def land_micro_batch(runner, mb: MicroBatch) -> tuple[list[Request], torch.Tensor | None, dict]:
    """(the requests that sample, their logits, the prompt logprobs by request id) of a launched micro-batch."""
    receive(runner, mb)
    sampled, logits_of = mb.logits
    return mb.sample_reqs, sampled, runner._prompt_logprobs(mb.prompt_rows, logits_of)
