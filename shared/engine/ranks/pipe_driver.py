"""Rank 0's half of a pipeline step (shard_runner.py ``_stage_steps`` is the other stages' half): the
scheduled requests are cut into up to one micro-batch per stage, contiguous and about even in tokens.
Every micro-batch's inputs go out to the stages first; then rank 0 runs stage 0 on each in turn, handing
each on without waiting, so stage 1 works on micro-batch 0 while stage 0 works on micro-batch 1; last, rank
0 receives each micro-batch's logits from the last stage. Sampling sees the micro-batches' sampled rows
concatenated, in the scheduler's order."""

from dataclasses import replace

import torch

from kvrelay.kernels import AttentionMetadata
from kvrelay.shared.engine.ranks.driver_step import logits_mode, step_message
from kvrelay.shared.engine.ranks.pipe_step import Pending, recv_logits, send_carried
from kvrelay.shared.engine.request import Request
from kvrelay.shared.engine.scheduler import ScheduledRequest, SchedulerOutput
from kvrelay.shared.engine.step_inputs import to_device, to_host


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


def pipeline_step(runner, out: SchedulerOutput) -> tuple[list[Request], torch.Tensor | None, dict]:
    """Run one step of ``runner`` (rank 0's ModelRunner, stage 0) through the pipeline: (the requests that
    sample, in order; their logits [R, V] or None; the step's prompt logprobs by request id)."""
    ranks, device = runner.ranks, runner.device
    at, state = ranks.layout, ranks.state
    built = []
    parts = split(out.scheduled, at.pp)
    for part in parts:  # every stage gets the whole step before any of them runs
        batch, sample_reqs, prompt_rows = runner._build(replace(out, scheduled=part))
        filled = to_host(batch, device)
        mode = logits_mode(bool(sample_reqs), bool(prompt_rows))
        ranks.send(replace(step_message(batch, filled[0], mode), micro_batches=len(parts)),
                   memoryview(filled[1].numpy()))
        built.append((batch, sample_reqs, prompt_rows, filled, mode))
    outgoing, rows = Pending(), []
    for i, (batch, _, _, filled, _) in enumerate(built):
        t = to_device(batch, device, filled)
        meta = AttentionMetadata(
            slot_mapping=t.slot_mapping, query_start_loc=t.query_start_loc, seq_lens=t.seq_lens,
            block_tables=t.block_tables, query_start_loc_cpu=batch.query_start_loc,
            seq_lens_cpu=batch.seq_lens, max_query_len=batch.max_query_len, max_seq_len=max(batch.seq_lens),
        )
        send_carried(state, runner.model(t.input_ids, t.positions, runner.kv_cache, meta), at.next_peer, i, outgoing)
        rows.append(t.sample_rows)
    reqs: list[Request] = []
    logits: list[torch.Tensor] = []
    prompt: dict = {}
    for i, ((batch, sample_reqs, prompt_rows, _, mode), sample_rows) in enumerate(zip(built, rows, strict=True)):
        sampled, logits_of = recv_logits(state, runner.model.vocab_size, batch, sample_rows, mode,
                                         at.logits_sender, i)
        if sample_reqs:
            reqs += sample_reqs
            logits.append(sampled)
        prompt.update(runner._prompt_logprobs(prompt_rows, logits_of))
    outgoing.wait()
    return reqs, (torch.cat(logits) if len(logits) > 1 else logits[0] if logits else None), prompt
