"""Prefill worker main loop.

Lifecycle of one job here:
  1. XREADGROUP (or XAUTOCLAIM of a dead peer's pending job) -> decode + validate the Job; a job past
     its deadline or aborted is answered "abort" and ACKed; an invalid one gets an error event.
  2. The engine core prefills it with other prompts under the token budget (chunked prefill) and
     samples the first token; the core keeps its KV blocks (hold_finished_kv).
  3. The first token goes straight to the gateway (TTFT does not wait for the handoff).
  4. Finished already (EOS, a stop id, max_tokens=1, context full): XACK, free the blocks.
     Otherwise a HandoffManager transfer moves the KV to a decode worker; its ack means the decode
     side holds the request, and only then is the job XACKed.
A worker killed anywhere before the XACK leaves the job pending for a peer to reclaim; the decode side
refuses a request id it already holds, so a reclaimed job never yields two streams.

SIGTERM drains: no new jobs are read, those in the engine and in handoff finish (up to the drain
timeout), and what is left is handed back to the stream for a peer (``_abandon``).
"""

import dataclasses
import logging
import time

from prefill_worker.handoff import HandoffManager, State, Transfer
from prefill_worker.job_queue import JobQueue, replayable
from shared.outputs import EngineCoreOutput
from shared.protocol import Job, TokenEvent
from shared.sampling_params import SamplingParams
from shared.worker_runtime import WorkerConfig, WorkerRuntime, token_event

log = logging.getLogger(__name__)

IDLE_BLOCK_MS = 50


class PrefillWorker:
    def __init__(self, config: WorkerConfig):
        self.runtime = WorkerRuntime(config, hold_finished_kv=True)
        self.core = self.runtime.core
        self.jobs = JobQueue(self.runtime.redis, config.model_name, config.worker_id, config.reclaim_idle_ms,
                             config.max_deliveries, on_dead=self._dead_job)
        self.handoff = HandoffManager(self.runtime.ctx, self.runtime, config.handoff_timeout_s)
        self.active: dict[str, tuple[bytes, Job]] = {}  # request id -> (stream entry, job) in the engine
        self.real_max_tokens: dict[str, int] = {}  # the engine here stops every request after one token

    def run(self) -> None:
        self.runtime.start(zmq_addr="")  # prefill binds nothing: it dials decode workers
        self.runtime.serve_forever(self.step, busy=lambda: bool(self.active) or self.handoff.busy,
                                   abandon=self._abandon)

    def step(self) -> None:
        self._handle_aborts()
        room = self.core.config.scheduler.max_num_seqs - len(self.active)
        busy = self.core.has_unfinished() or self.handoff.busy
        if room > 0 and not self.runtime.draining:
            for entry_id, job in self.jobs.fetch(room, block_ms=0 if busy else IDLE_BLOCK_MS):
                self._admit(entry_id, job)
        if self.core.has_unfinished():
            for out in self.core.step():
                self._on_output(out)
        for t in self.handoff.poll(timeout_ms=0 if self.core.has_unfinished() else 5):
            self._on_transfer_end(t)
        self.runtime.events.flush()

    # -- intake ---------------------------------------------------------------------------------
    def _admit(self, entry_id: bytes, job: Job) -> None:
        rid = job.request_id
        if rid in self.active or rid in self.handoff.transfers:
            return  # our own pending job reclaimed back to us: it is still in progress here
        if job.deadline and time.time() > job.deadline:
            self._finish(entry_id, job, TokenEvent(request_id=rid, finish_reason="abort"))
            return
        try:
            params = SamplingParams.from_dict(job.sampling)
            req = self.core.make_request(rid, job.prompt_token_ids, params,
                                         self.runtime.eos_ids[0] if self.runtime.eos_ids else None,
                                         job.priority, job.cache_salt, tenant=job.tenant, arrival=job.arrival)
        except (ValueError, TypeError) as exc:
            self._finish(entry_id, job, TokenEvent(request_id=rid, finish_reason="error", error=str(exc)))
            return
        req.sampling_params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + [
            t for t in self.runtime.eos_ids[1:] if not params.ignore_eos])
        self.real_max_tokens[rid] = req.max_tokens
        req.max_tokens = 1  # this worker only produces the first token
        self.active[rid] = (entry_id, job)
        self.core.add_request(req)

    # -- results --------------------------------------------------------------------------------
    def _on_output(self, out: EngineCoreOutput) -> None:
        rid = out.request_id
        entry_id, job = self.active.pop(rid, (None, None))
        if job is None:
            return
        real_max = self.real_max_tokens.pop(rid, 1)
        req_finished_for_real = out.finish_reason in ("stop", "abort") or real_max <= 1 or (
            len(job.prompt_token_ids) + 1 >= self.core.max_model_len)
        # no worker_id: after the handoff this worker no longer holds the request, and if it dies
        # first the job is reclaimed by a peer rather than failed at the gateway
        event = token_event(out, output_index=0, worker_id="")
        if req_finished_for_real:
            event.finish_reason = out.finish_reason or "length"
            self.runtime.metrics.request_done(event.finish_reason, job.arrival)
            self.core.scheduler.release_held(rid)
            self._finish(entry_id, job, event)
            return
        event.finish_reason = None  # the prefill cap is ours, not the request's
        self.runtime.events.add(job.reply_addr, event)
        self.handoff.start(Transfer(
            job=job, entry_id=entry_id, first_token=out.new_token_ids[0],
            first_logprob=event.logprobs[0] if event.logprobs else None,
            first_top=event.top_logprobs[0] if event.top_logprobs else None,
            prompt_logprobs=None, num_cached_tokens=out.num_cached_tokens,
        ))

    def _on_transfer_end(self, t: Transfer) -> None:
        self.runtime.metrics.handoff_done(t.nbytes, time.perf_counter() - t.started, t.state is State.DONE)
        if t.state is State.DONE:
            self.jobs.ack(t.entry_id)
            log.debug("handed off %s (%d bytes) in %.1f ms", t.job.request_id, t.nbytes,
                      (time.perf_counter() - t.started) * 1000)
            return
        self._finish(t.entry_id, t.job, TokenEvent(request_id=t.job.request_id, finish_reason="error",
                                                   error=f"KV handoff failed: {t.reason}", output_index=1))

    def _finish(self, entry_id: bytes, job: Job, event: TokenEvent) -> None:
        self.runtime.events.add(job.reply_addr, event)
        self.jobs.ack(entry_id)

    def _dead_job(self, job: Job, reason: str) -> None:
        self.runtime.events.add(job.reply_addr, TokenEvent(request_id=job.request_id, finish_reason="error",
                                                           error=f"request failed repeatedly: {reason}"))

    def _abandon(self) -> None:
        """Drain timeout: jobs not yet prefilled go back to the stream. So do those waiting for a decode
        grant when a peer would repeat their first token exactly; the others end with an error, since
        their client already has a first token a peer might not repeat. Jobs whose KV already left wait
        for the decode side's ack, which a peer's reclaim covers if it never comes."""
        back = []
        for rid, (entry_id, _job) in list(self.active.items()):
            self.core.abort([rid])
            back.append(entry_id)
        self.active.clear()
        for rid, t in list(self.handoff.transfers.items()):
            if t.state is not State.GRANT_WAIT:
                continue
            self.handoff.cancel(rid)
            if replayable(t.job):
                back.append(t.entry_id)
            else:
                self._finish(t.entry_id, t.job, TokenEvent(request_id=rid, finish_reason="error", output_index=1,
                                                           error="prefill worker shut down during the handoff"))
        self.jobs.hand_back(back)
        log.info("handed %d job(s) back to the stream", len(back))

    def _handle_aborts(self) -> None:
        for rid in self.runtime.drain_aborts():
            if rid in self.active:
                entry_id, _ = self.active.pop(rid)
                self.core.abort([rid])
                self.jobs.ack(entry_id)
            t = self.handoff.cancel(rid)
            if t is not None:
                self.jobs.ack(t.entry_id)

