"""Prefill worker main loop.

Lifecycle of one job here:
  1. XREADGROUP (or XAUTOCLAIM of a dead peer's pending job) -> decode + validate the Job; a job past
     its deadline or aborted is answered "abort" and ACKed; an invalid one gets an error event.
  2. Once its last chunk is due within two steps, it asks a decode worker for blocks early (a
     HandoffManager transfer), so that when that chunk runs the KV leaves layer by layer as the
     forward writes it.
  3. The engine core prefills it with other prompts under the token budget (chunked prefill) and
     samples the first token; the core keeps its KV blocks (hold_finished_kv).
  4. The first token goes straight to the gateway: a step's first tokens are sent before any of its
     handoffs starts (TTFT waits for neither the handoff nor a batch's other handoffs to set up).
  5. Finished already (EOS, a stop id, max_tokens=1, context full): the early grant is cancelled,
     XACK, free the blocks. Otherwise the transfer completes (or starts, without an early grant) and
     moves the KV to a decode worker; its ack means the decode side holds the request, and only then,
     after an event naming that worker to the gateway, is the job XACKed.
Until its first token a job is an InFlight of the worker's Lifecycle (shared/worker/lifecycle.py), which
ends it on a gateway's abort, its deadline, or its gateway's death; from then on its Transfer holds it,
and a gateway's abort cancels that.
A worker killed anywhere before the XACK leaves the job pending for a peer to reclaim; the decode side
refuses a request id it already holds, so a reclaimed job never yields two streams. A decode worker that
leaves the registry after the KV went out but before its ack (prefill_worker/handoff.py) held nothing:
the job goes back to the stream when a re-run repeats its text exactly, else it ends with an error. Having
admitted it, that worker may have told the gateway it held it, and the gateway re-runs such a job too:
one claim in Redis lets exactly one of them do it (shared/wire/rerun.py).

SIGTERM drains: no new jobs are read, those in the engine and in handoff finish (up to the drain
timeout), and what is left is handed back to the stream for a peer (``_abandon``).

Several models: each instance the worker hosts (shared/worker/model_host.py) has its own stream, JobQueue and
engine; one step serves each in turn, and one HandoffManager carries all their KV. A draining instance
(a swap's old version) keeps reading its stream until it is empty and nothing of it is in flight.
"""

import logging
import time

import redis

from kvrelay.prefill_worker.handoff import FirstToken, HandoffManager, State, Transfer
from kvrelay.shared.config.worker import WorkerConfig
from kvrelay.shared.engine.outputs import EngineCoreOutput
from kvrelay.shared.wire import rerun
from kvrelay.shared.wire.job_queue import replayable
from kvrelay.shared.wire.protocol import Job, TokenEvent
from kvrelay.shared.worker.intake import IDLE_BLOCK_MS, IDLE_SLEEP_S, JobIntake
from kvrelay.shared.worker.model_slot import ModelSlot
from kvrelay.shared.worker.runtime import WorkerRuntime
from kvrelay.shared.worker.token_event import stamp_first_token, token_event

log = logging.getLogger(__name__)

EARLY_GRANT_STEPS = 2  # ask a decode worker for blocks once a prompt's last chunk is this many steps away


class PrefillWorker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.runtime = WorkerRuntime(config, hold_finished_kv=True)
        self.intake = JobIntake(self.runtime, config)
        self.inflight = self.intake.inflight
        self.handoff = HandoffManager(self.runtime.ctx, self.runtime, config.handoff_timeout_s,
                                      core_for=self._core_for, curve=self.runtime.curve,
                                      stalled_step_timeout_s=config.stalled_step_timeout_s)
        # a prefilled job waiting for a decode grant (none while its decode worker restarts) is still ours:
        # reclaimed as abandoned, each XAUTOCLAIM would count a delivery until it was dead-lettered
        self.intake.held_elsewhere = lambda instance: [
            t.entry_id for t in self.handoff.transfers.values() if t.job.model == instance and t.entry_id]
        self.inflight.on_gateway_gone = self._drop_handoffs_of

    def run(self) -> None:
        self.runtime.start(zmq_addr="", hooks=self)  # prefill binds nothing: it dials decode workers
        self.runtime.serve_forever(self.step, busy=self._busy, abandon=self._abandon)

    def _core_for(self, instance: str):
        slot = self.runtime.slots.get(instance)
        return None if slot is None else slot.core

    def _busy(self) -> bool:
        return self.handoff.busy or bool(self.inflight)

    # -- RoleHooks: the host's models come and go ---------------------------------------------------
    def attach(self, slot: ModelSlot) -> None:
        self.intake.attach(slot)
        if slot.metrics is not None:
            slot.metrics.seat_waiting = lambda instance=slot.instance: self.handoff.waiting_for_seat(instance)
            slot.metrics.quota_waiting = lambda instance=slot.instance: self.handoff.waiting_for_seat(instance, True)
        if self.config.stream_kv_layers and slot.core.kv.sharded:  # its blocks are gathered between steps
            log.info("%s runs on several ranks: its KV leaves after each prompt's prefill, not layer by layer",
                     slot.instance)
        elif self.config.stream_kv_layers:
            slot.core.kv.set_layer_saver(self.handoff.stream_for(slot.instance))

    def detach(self, slot: ModelSlot) -> None:
        self.handoff.forget_model(slot.instance)
        self.intake.detach(slot)

    def idle(self, slot: ModelSlot) -> bool:
        return not self.handoff.has_model(slot.instance) and self.intake.idle(slot)

    def may_unload(self, slot: ModelSlot) -> bool:
        return self.idle(slot)

    def busy(self, slot: ModelSlot) -> bool:
        return self.handoff.has_model(slot.instance) or self.intake.busy(slot)

    # -- the loop -----------------------------------------------------------------------------------
    def step(self) -> None:
        for rid in self.inflight.sweep():  # aborted after its first token: its handoff holds it
            t = self.handoff.cancel(rid)
            if t is not None:
                self.intake.ack(t.job.model, t.entry_id)
        slots = list(self.runtime.slots.values())
        busy = self.handoff.busy or any(s.core.has_unfinished() for s in slots)
        block_ms = 0 if busy or len(slots) != 1 else IDLE_BLOCK_MS
        fetched = 0
        for slot in slots:
            fetched += self._fetch(slot, block_ms)
            if self.config.stream_kv_layers and not slot.core.kv.sharded:
                self._ask_early(slot)
        if self.handoff.busy:  # grants that came during the last step, so this step's forward can stream
            for t in self.handoff.poll(timeout_ms=0):
                self._on_transfer_end(t)
        stepped = False
        prefilled: list[tuple[Job, bytes, FirstToken]] = []
        for slot in slots:
            if slot.core.has_unfinished():
                stepped = True
                step_started = time.time()
                for out in slot.core.step():
                    self._on_output(slot, out, step_started, prefilled)
        if prefilled:  # the step's first tokens leave before its handoffs start: a batch's TTFT never waits on them
            self.runtime.events.flush()
        for job, entry_id, first in prefilled:
            self.handoff.prefilled(job, entry_id, first)
        for t in self.handoff.poll(timeout_ms=0 if stepped else 5):
            self._on_transfer_end(t)
        self.runtime.events.flush()
        if not slots:
            self.runtime.stop.wait(0.02)  # nothing loaded yet: wait for a load command
        elif len(slots) > 1 and not (busy or fetched or stepped):
            time.sleep(IDLE_SLEEP_S)

    def _drop_handoffs_of(self, reply_addr: str) -> None:
        """Its gateway is gone: its prefilled requests waiting for a decode seat (or on their way to one)
        leave too, rather than take seats the other gateways' requests wait for."""
        dropped = 0
        for rid, t in list(self.handoff.transfers.items()):
            if t.job.reply_addr != reply_addr or not self.inflight.unwanted(t.job):
                continue
            self.handoff.cancel(rid)
            dropped += 1
            if t.computed:  # before that, its job is the Lifecycle's, which ended it already
                self.intake.ack(t.job.model, t.entry_id)
        if dropped:
            log.warning("gateway %s is gone: dropped its %d request(s) in handoff", reply_addr, dropped)

    # -- intake ---------------------------------------------------------------------------------
    def _fetch(self, slot: ModelSlot, block_ms: int) -> int:
        jobs = self.intake.fetch(slot, block_ms)
        for entry_id, job in jobs:
            t = self.handoff.transfers.get(job.request_id)
            if t is not None and (t.entry_id == entry_id or not t.computed):
                continue  # our own pending job reclaimed back to us: it is still in progress here
            if t is not None:
                # a new entry of a job we are handing off: the gateway queued it again because the decode
                # worker that told it it held the job died, and it claimed the re-run (shared/wire/rerun.py);
                # that worker will never ack, so the old transfer ends now rather than when we see it gone
                log.warning("request %s: decode worker %s left; its gateway queued it again already",
                            job.request_id, t.target_id)
                self.handoff.cancel(job.request_id)
                self.intake.ack(slot.instance, t.entry_id)
            admitted = self.intake.admit(slot, entry_id, job)
            if admitted is not None:
                _rec, req = admitted
                req.max_tokens = 1  # this worker only produces the first token
                slot.core.add_request(req)
        return len(jobs)

    def _ask_early(self, slot: ModelSlot) -> None:
        """Early grants for the prompts whose last chunk is due within EARLY_GRANT_STEPS steps: in
        scheduling order (running first, then waiting), counting the prompt tokens computed before each
        one's last chunk. Asking earlier would hold decode blocks idle while prompts wait; later, the
        grant (a round trip through the decode worker's loop) would miss the last chunk."""
        step = slot.core.max_num_batched_tokens
        ahead = 0  # prompt tokens scheduled before this request's
        for req in slot.core.scheduling_order():
            remaining = req.num_prompt_tokens - req.num_computed_tokens
            if ahead + max(0, remaining - step) > EARLY_GRANT_STEPS * step:
                return
            ahead += remaining
            rid = req.request_id
            rec = self.inflight.get(rid)
            if rid in self.handoff.transfers or rec is None or rec.job is None or rec.max_tokens <= 1:
                continue
            if req.num_prompt_tokens + 1 >= slot.core.max_model_len:
                continue  # ends at its first token: nothing to hand off
            self.handoff.start_early(rec.job, rec.entry_id)

    # -- results --------------------------------------------------------------------------------
    def _on_output(self, slot: ModelSlot, out: EngineCoreOutput, step_started: float,
                   prefilled: list[tuple[Job, bytes, FirstToken]]) -> None:
        """Its first token queued for the gateway; a request that goes on to decode joins ``prefilled``, whose
        handoffs start once the step's first tokens are sent."""
        rid = out.request_id
        rec = self.inflight.get(rid)
        if rec is None or rec.job is None:
            return
        job = rec.job
        slot.touch()
        finished_for_real = out.finish_reason in ("stop", "abort", "error") or rec.max_tokens <= 1 or (
            len(job.prompt_token_ids) + 1 >= slot.core.max_model_len)
        # no worker_id: after the handoff this worker no longer holds the request, and if it dies
        # first the job is reclaimed by a peer rather than failed at the gateway
        event = token_event(out, output_index=0, worker_id="")
        stamp_first_token(event, rec, step_started)
        if finished_for_real:
            event.finish_reason = out.finish_reason or "length"
            if slot.metrics is not None:
                slot.metrics.request_done(event.finish_reason, job.arrival)
            self.handoff.cancel(rid)  # an early grant's blocks go back; streamed copies finish first
            slot.core.kv.release_held(rid)
            self.inflight.finish(rid, event)
            return
        event.finish_reason = None  # the prefill cap is ours, not the request's
        self.inflight.send(rec, event)
        self.inflight.hand_over(rid)
        prefilled.append((job, rec.entry_id, FirstToken(
            out.new_token_ids[0], event.logprobs[0] if event.logprobs else None,
            event.top_logprobs[0] if event.top_logprobs else None, out.num_cached_tokens)))

    def _on_transfer_end(self, t: Transfer) -> None:
        slot = self.runtime.slots.get(t.job.model)
        if slot is None:
            log.error("transfer of %s ended after its model %s left", t.job.request_id, t.job.model)
            return
        slot.touch()
        if slot.metrics is not None:
            slot.metrics.handoff_done(t.nbytes, time.perf_counter() - t.started, t.state is State.DONE,
                                      t.transport, t.streamed, t.seat_wait_s)
        if t.state is State.DONE:
            # Name the decode worker holding the request to its gateway, as that worker did before it acked.
            # Its own announcement can still be queued there when its ack arrives here (a first event to a
            # gateway waits for the connection's handshake), and if it dies then, this is what tells the
            # gateway whose heartbeat to watch instead of leaving the stream open until its deadline.
            self.runtime.events.add(t.job.reply_addr, TokenEvent(request_id=t.job.request_id, output_index=1,
                                                                 worker_id=t.target_id))
            self.intake.ack(slot.instance, t.entry_id)
            log.debug("handed off %s (%d bytes) in %.1f ms", t.job.request_id, t.nbytes,
                      (time.perf_counter() - t.started) * 1000)
            return
        if t.target_lost and not t.computed:
            return  # its prompt is still computing: its first token starts a transfer to another decode worker
        if t.target_lost and replayable(t.job):
            # its decode worker left before acking it, so nothing holds it: run it again (here or on a
            # peer), and the gateway keeps the tokens its client has and takes the rest of the same text;
            # unless the gateway, which that worker may have told it held the request, re-ran it first
            if not self._claim_rerun(t):
                log.warning("request %s: %s; its gateway queued it again already", t.job.request_id, t.reason)
                self.intake.ack(slot.instance, t.entry_id)
                return
            log.warning("request %s: %s; its job goes back to the stream", t.job.request_id, t.reason)
            self.intake.hand_back([(slot.instance, t.entry_id)])
            return
        self.intake.answer(slot.instance, t.entry_id, t.job, TokenEvent(
            request_id=t.job.request_id, finish_reason="error", error=f"KV handoff failed: {t.reason}",
            output_index=1))

    def _claim_rerun(self, t: Transfer) -> bool:
        """Is the re-run of a job whose decode worker died unacked ours (shared/wire/rerun.py)?"""
        try:
            return rerun.claim(self.runtime.redis, t.job.request_id, t.target_id, t.job.deadline,
                               self.config.worker_id)
        except redis.RedisError:
            return True  # cannot tell: hand it back, which a Redis that is down defers to a peer's reclaim

    def _abandon(self) -> None:
        """Drain timeout: jobs not yet prefilled go back to the stream. So do those waiting for a decode
        grant when a peer would repeat their first token exactly; the others end with an error, since
        their client already has a first token a peer might not repeat. Jobs whose KV already left wait
        for the decode side's ack, which a peer's reclaim covers if it never comes."""
        back = [(rec.instance, rec.entry_id) for rec in self.inflight.abandon()]
        for rid, t in list(self.handoff.transfers.items()):
            if not t.computed:  # an early ask: its job went back above
                self.handoff.cancel(rid)
                continue
            if t.state is not State.GRANT_WAIT:
                continue
            self.handoff.cancel(rid)
            slot = self.runtime.slots.get(t.job.model)
            if slot is None:
                continue
            if replayable(t.job):
                back.append((slot.instance, t.entry_id))
            else:
                self.intake.answer(slot.instance, t.entry_id, t.job, TokenEvent(
                    request_id=rid, finish_reason="error", output_index=1,
                    error="prefill worker shut down during the handoff"))
        self.intake.hand_back(back)
        log.info("handed %d job(s) back to the stream", len(back))
