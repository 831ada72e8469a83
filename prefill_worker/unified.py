"""Unified worker: one process pulls jobs, prefills and decodes them, no handoff. For comparison with
the disaggregated path and for small setups (`kvrelay serve --mode unified`).

Lifecycle of one job here: XREADGROUP/XAUTOCLAIM -> validate -> engine (continuous batching, chunked
prefill) -> token events to the gateway every step -> finished, aborted or past its deadline -> XACK.
The job is ACKed only when the request ends, so a killed worker's jobs are reclaimed by a peer.
SIGTERM drains: no new jobs are read, running ones finish (up to the drain timeout), the rest are handed
back to the stream or, when a peer could not continue their text exactly, ended (``_abandon``).
"""

import dataclasses
import logging
import time

from prefill_worker.job_queue import JobQueue, replayable
from shared.protocol import Job, TokenEvent
from shared.sampling_params import SamplingParams
from shared.worker_runtime import WorkerConfig, WorkerRuntime, token_event

log = logging.getLogger(__name__)


class UnifiedWorker:
    def __init__(self, config: WorkerConfig):
        self.runtime = WorkerRuntime(config)
        self.core = self.runtime.core
        self.jobs = JobQueue(self.runtime.redis, config.model_name, config.worker_id, config.reclaim_idle_ms,
                             config.max_deliveries, on_dead=self._dead_job)
        self.active: dict[str, tuple[bytes, Job, int]] = {}  # id -> (entry, job, tokens sent)

    def run(self) -> None:
        self.runtime.start(zmq_addr="")
        self.runtime.serve_forever(self.step, busy=lambda: bool(self.active), abandon=self._abandon)

    def step(self) -> None:
        aborted = self.runtime.drain_aborts()
        now = time.time()
        expired = [rid for rid, (_, job, _) in self.active.items() if job.deadline and now > job.deadline]
        for rid in aborted + expired:
            if rid in self.active:
                entry_id, job, sent = self.active.pop(rid)
                self.core.abort([rid])
                self._end(entry_id, job, TokenEvent(request_id=rid, finish_reason="abort", output_index=sent))
        room = self.core.config.scheduler.max_num_seqs - len(self.active)
        if room > 0 and not self.runtime.draining:
            busy = self.core.has_unfinished()
            for entry_id, job in self.jobs.fetch(room, block_ms=0 if busy else 50):
                self._admit(entry_id, job)
        if self.core.has_unfinished():
            for out in self.core.step():
                if out.request_id not in self.active:
                    continue
                entry_id, job, sent = self.active[out.request_id]
                # no worker_id: a dead unified worker's jobs are reclaimed by a peer, not failed
                event = token_event(out, sent, worker_id="")
                if out.finished:
                    del self.active[out.request_id]
                    self._end(entry_id, job, event)
                else:
                    self.active[out.request_id] = (entry_id, job, sent + len(out.new_token_ids))
                    self.runtime.events.add(job.reply_addr, event)
        self.runtime.events.flush()

    def _admit(self, entry_id: bytes, job: Job) -> None:
        rid = job.request_id
        if rid in self.active:
            return  # reclaimed back to ourselves: still running here
        if job.deadline and time.time() > job.deadline:
            self._end(entry_id, job, TokenEvent(request_id=rid, finish_reason="abort"))
            return
        try:
            params = SamplingParams.from_dict(job.sampling)
            eos = self.runtime.eos_ids
            if not params.ignore_eos:
                params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + eos[1:])
            req = self.core.make_request(rid, job.prompt_token_ids, params, eos[0] if eos else None,
                                         job.priority, job.cache_salt, tenant=job.tenant, arrival=job.arrival)
        except (ValueError, TypeError) as exc:
            self._end(entry_id, job, TokenEvent(request_id=rid, finish_reason="error", error=str(exc)))
            return
        self.active[rid] = (entry_id, job, 0)
        self.core.add_request(req)

    def _end(self, entry_id: bytes, job: Job, event: TokenEvent) -> None:
        self.runtime.events.add(job.reply_addr, event)
        self.jobs.ack(entry_id)

    def _abandon(self) -> None:
        """Drain timeout. A job with no token sent yet, or a greedy/seeded one (a peer re-running it
        repeats the tokens the client has, which the gateway drops as duplicates), goes back to the
        stream; any other ends with an error event, since a peer would continue a different text."""
        back = []
        for rid, (entry_id, job, sent) in list(self.active.items()):
            self.core.abort([rid])
            if sent == 0 or replayable(job):
                back.append(entry_id)
            else:
                self._end(entry_id, job, TokenEvent(request_id=rid, finish_reason="error", output_index=sent,
                                                    error="worker shut down before the request finished"))
        self.active.clear()
        self.jobs.hand_back(back)
        log.info("handed %d job(s) back to the stream", len(back))

    def _dead_job(self, job: Job, reason: str) -> None:
        self.runtime.events.add(job.reply_addr, TokenEvent(request_id=job.request_id, finish_reason="error",
                                                           error=f"request failed repeatedly: {reason}"))
