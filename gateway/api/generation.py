"""One client request in flight: fan out into jobs, queue them, turn the workers' events into deltas.

    async with Generation(request, prepared) as gen:
        async for delta in gen: ...

Leaving the block early for any reason (client gone, deadline, error, handler cancelled) publishes an
Abort for every job not yet finished, so workers free their KV blocks within a step.
"""

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import redis
from aiohttp import web

from kvrelay.gateway.api.choice import ChoiceDelta, ChoiceState
from kvrelay.gateway.api.hangup import client_hung_up
from kvrelay.gateway.api.output_constraints import compile_error
from kvrelay.gateway.api.prompts import Prepared
from kvrelay.gateway.control.reload_wait import ReloadWatch
from kvrelay.gateway.control.routing import ROUTER, candidates
from kvrelay.gateway.control.worker_registry import WORKER_REGISTRY
from kvrelay.gateway.drain import DRAIN, draining_error
from kvrelay.gateway.errors import ARRIVAL, REQUEST_ID, APIError, ClientGone
from kvrelay.gateway.queue_lengths import QUEUE_LENGTHS
from kvrelay.gateway.queued_jobs import QueuedRequest
from kvrelay.gateway.redis_watch import REDIS_WATCH, redis_failed
from kvrelay.gateway.state import CONFIG, DISPATCHER, METRICS, REDIS, spawn
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire import rerun
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.job_queue import replayable
from kvrelay.shared.wire.priority_bands import job_stream, shared_streams
from kvrelay.shared.wire.protocol import Abort, Job, TokenEvent

log = logging.getLogger("kvrelay.gateway")

# how often one request's jobs are queued again after their decode worker died (a second death fails it)
MAX_REQUEUES = 1

# XADD to a worker's private stream only while it exists: its worker creates it (with the consumer group)
# before it can be routed to, and a peer deletes it once the worker is long dead and it is empty, so a
# job routed on a stale view of the workers lands on the shared stream instead of where nobody reads.
# Answers the stream it chose and the entry id: where to look for the job after a Redis restart.
_XADD_PRIVATE = """
local key = KEYS[2]
if redis.call('EXISTS', KEYS[1]) == 1 then key = KEYS[1] end
return {key, redis.call('XADD', key, 'MAXLEN', '~', ARGV[1], '*', ARGV[2], ARGV[3])}
"""


async def publish_abort(app: web.Application, job_ids: list[str], reason: str) -> None:
    try:
        await app[REDIS].publish(keys.ABORT_CHANNEL, encode(Abort(request_ids=job_ids, reason=reason)))
    except redis.RedisError as exc:
        # Workers also drop jobs past their deadline, so a lost abort costs capacity, not correctness.
        if not redis_failed(app, exc):
            log.warning("could not publish abort for %s: %s", job_ids, exc)


class Generation:
    def __init__(self, request: web.Request, prepared: Prepared, whole_request: bool = True):
        """``whole_request``: False for one step of a larger request (a beam search's), whose TTFT that request
        observes."""
        self.app = app = request.app
        self._whole_request = whole_request
        self.prepared = prepared
        # Our own id, never the client's X-Request-Id: job ids must be unique across every client.
        self.request_id = uuid.uuid4().hex
        self.client_request_id: str = request[REQUEST_ID]
        self._request = request
        config = app[CONFIG]
        self._poll_s = config.disconnect_poll_s
        # set by a stream that holds its chunks while events are waiting here (api/sse.py), to write them
        # before this waits for the next one
        self.before_wait: Callable[[], Awaitable[None]] | None = None
        # a beam search's step starts now; a whole request when the gateway first saw it (errors.ARRIVAL)
        self.arrival = request.get(ARRIVAL, time.time()) if whole_request else time.time()
        self.deadline = self.arrival + config.request_timeout
        self.first_token_at: float | None = None  # unix seconds; arrival to here is the client's TTFT
        # job id -> unix seconds its job went to Redis, first to last (a requeue adds one): TTFT's stages
        self._enqueued: dict[str, list[float]] = {}
        params = prepared.params
        self.choices: list[ChoiceState] = []
        for p, prompt in enumerate(prepared.prompts):
            for i in range(params.n):
                index = p * params.n + i
                # Workers only ever see n=1; seeded requests stay reproducible yet distinct per choice.
                child = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
                self.choices.append(ChoiceState(index=index, job_id=f"{self.request_id}-{index}", prompt_index=p,
                                                prompt_token_ids=prompt, params=child,
                                                tokenizer=prepared.tokenizer))
        self._by_job = {c.job_id: c for c in self.choices}
        self._queue: asyncio.Queue[TokenEvent] | None = None
        # job id -> the decode worker holding its KV (events name it); a holder whose heartbeat lapses
        # is dead, and its requests end with an error instead of waiting out the deadline
        self._holders: dict[str, str] = {}
        self._requeues = 0
        self._reply_addr = ""  # where our jobs' workers send events (the dispatcher's address)
        # where Redis holds our jobs that no worker answered for yet (redis_watch.py: lost after a restart)
        self._queued: QueuedRequest | None = None
        # its model leaving every worker while the jobs wait reloads it, and the request waits for that load
        self._reload = ReloadWatch(app, prepared.model.name, prepared.model_name, self.deadline)
        model = prepared.model
        self._banded = model.scheduling_policy == "priority"
        # where the jobs queue unless routed to a worker's stream: the shared stream, or under the priority
        # policy the stream of the priority's band (shared/wire/priority_bands.py)
        self._stream = job_stream(model.name, prepared.priority, model.scheduling_policy)

    @property
    def model_name(self) -> str:
        return self.prepared.model_name

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prepared.prompts)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from a prefix cache, counted once per prompt like prompt_tokens."""
        return sum(max((c.num_cached_tokens for c in self.choices if c.prompt_index == p), default=0)
                   for p in range(len(self.prepared.prompts)))

    def usage(self) -> dict:
        prompt, completion = self.num_prompt_tokens, self.num_completion_tokens
        enabled = self.app[CONFIG].enable_prompt_tokens_details
        details = {"cached_tokens": self.num_cached_tokens} if enabled else None
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": details}

    async def __aenter__(self) -> "Generation":
        dispatcher = self.app[DISPATCHER]
        self._queue = dispatcher.register(list(self._by_job))
        try:
            await self._submit(dispatcher.address)
        except BaseException as exc:
            dispatcher.unregister(list(self._by_job))
            if not isinstance(exc, APIError | ClientGone):  # cancelled mid-XADD: some jobs may be queued already
                spawn(self.app, publish_abort(self.app, list(self._by_job), "client disconnected"))
            raise
        self.app[METRICS].vllm.start(self)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.app[DISPATCHER].unregister(list(self._by_job))
        self._reload.cancel()
        if self._queued is not None:
            self.app[REDIS_WATCH].queued.discard(self._queued)
        self.app[METRICS].vllm.finish(self)
        unfinished = [c.job_id for c in self.choices if not c.finished]
        if unfinished:
            gone = isinstance(exc_info[1], ClientGone | asyncio.CancelledError) or self._is_disconnected()
            reason = "client disconnected" if gone else "gateway gave up on the request"
            spawn(self.app, publish_abort(self.app, unfinished, reason))

    def _is_disconnected(self) -> bool:
        transport = self._request.transport
        return transport is None or transport.is_closing()

    def _job(self, choice: ChoiceState) -> Job:
        config = self.app[CONFIG]
        return Job(request_id=choice.job_id, model=self.prepared.model.name, prompt_token_ids=choice.prompt_token_ids,
                   sampling=choice.params, tenant=self.prepared.tenant,
                   priority=self.prepared.priority, reply_addr=self._reply_addr,
                   # the workers' backstop for a lost abort: past ours by the one reload we may wait for
                   deadline=self.deadline + config.model_load_timeout,
                   arrival=self.arrival, cache_salt=self.prepared.cache_salt)

    async def _submit(self, reply_addr: str) -> None:
        self._reply_addr = reply_addr
        model = self.prepared.model.name
        config = self.app[CONFIG]
        retry = {"Retry-After": str(config.retry_after_s)}
        unavailable = APIError(503, "the request queue is unavailable", code="queue_unavailable", headers=retry)
        try:
            workers = candidates(await self.app[WORKER_REGISTRY].routable(), model)  # none stalled
            # the live workers' private streams are counted; a dead worker's leftovers are its peers' to
            # adopt within seconds and are not
            shared = shared_streams(model) if self._banded else [keys.prefill_stream(model)]
            lengths = await self.app[QUEUE_LENGTHS].read(model, shared, [w.worker_id for w in workers])
        except redis.RedisError:
            raise unavailable from None
        depth = lengths.depth
        # Checked before the XADD, not atomically with it: several gateways may overshoot by a few
        # requests each, which a soft bound tolerates.
        if config.max_queue_depth and depth + len(self.choices) > config.max_queue_depth:
            raise APIError(429, f"{depth} requests are queued for model {model!r} (limit "
                                f"{config.max_queue_depth}); retry later", code="queue_full", headers=retry)
        # The last look at the client before its jobs are queued, at the socket itself: a busy loop may wake
        # this handler before it reads the hang-up (or before aiohttp cancels the handler after reading it);
        # a job queued for nobody would cost a worker a prefill until the abort reaches it.
        if client_hung_up(self._request.transport):
            raise ClientGone()
        if self._stream == keys.prefill_stream(model):
            # routing adds what it sends each worker to the lengths this burst's requests share
            routed = self.app[ROUTER].route_choices(self.prepared.prompts, self.prepared.params.n, model,
                                                    self.prepared.model.block_size, self.prepared.tenant,
                                                    self.prepared.cache_salt, workers, lengths.private)
        else:  # a private stream is read ahead of band 0 only, so no band but 0 may wait in one
            routed = [None] * len(self.choices)
        lengths.shared += routed.count(None)
        pipe = self.app[REDIS].pipeline(transaction=False)
        streams: list[str | None] = []  # per choice: its stream, or None where the script says which
        for choice, worker in zip(self.choices, routed, strict=True):
            job = self._job(choice)
            if worker is None:
                pipe.xadd(self._stream, {keys.JOB_FIELD: encode(job)}, maxlen=config.stream_maxlen, approximate=True)
                streams.append(self._stream)
                continue
            pipe.eval(_XADD_PRIVATE, 2, keys.prefill_worker_stream(model, worker), keys.prefill_stream(model),
                      config.stream_maxlen, keys.JOB_FIELD, encode(job))
            streams.append(None)
        if config.redis_min_replicas:
            pipe.wait(config.redis_min_replicas, config.redis_replica_wait_ms)  # WAIT covers its own connection's writes
        # before the XADD, not after: a worker blocked on its stream reads the job before this coroutine resumes
        now = time.time()
        self._enqueued = {c.job_id: [now] for c in self.choices}
        try:
            replies = await pipe.execute()
            queued_at = time.monotonic()
        except redis.RedisError as exc:
            if not redis_failed(self.app, exc):
                log.error("cannot queue request %s (client id %s): %s", self.request_id, self.client_request_id, exc)
            raise unavailable from None
        if config.redis_min_replicas and replies.pop() < config.redis_min_replicas:
            self.app[METRICS].job_writes_unreplicated.inc(len(self.choices))
        jobs: dict[str, tuple[str, bytes]] = {}
        for choice, stream, reply in zip(self.choices, streams, replies, strict=True):
            if stream is None:
                stream, reply = reply[0].decode(), reply[1]
            jobs[choice.job_id] = (stream, reply)
        self._queued = self.app[REDIS_WATCH].queued.add(queued_at, jobs)

    async def _next_event(self) -> TokenEvent:
        """The next event for any choice; raises on deadline or a vanished client, never hangs."""
        assert self._queue is not None
        while True:
            if not self._queue.empty():
                return self._queue.get_nowait()
            if self.before_wait is not None:
                await self.before_wait()  # what its stream holds goes out now, before this waits for more
                if not self._queue.empty():
                    continue
            if self._is_disconnected():
                raise ClientGone()
            if self.app[DRAIN].expired:  # the gateway's drain deadline passed: end cleanly, now
                raise draining_error(self.app[CONFIG].retry_after_s)
            queued = self._queued
            if queued is not None and queued.jobs and (queued.lost or self.app[REDIS_WATCH].lost(queued.queued_at)):
                lost = len(queued.gone) if queued.lost else len(queued.jobs)
                self.app[METRICS].queued_jobs_lost.labels("gone" if queued.lost else "outage").inc(lost)
                log.warning("request %s (client id %s): %d queued job(s) lost by Redis (%s): 503 queue_lost",
                            self.request_id, self.client_request_id, lost,
                            "gone after a failover or restart" if queued.lost else "outage")
                raise APIError(503, "the request queue was lost (Redis restarted or unreachable); retry",
                               code="queue_lost", headers={"Retry-After": str(self.app[CONFIG].retry_after_s)})
            remaining = max(self.deadline, self._reload.hold_until) - time.time()
            if remaining <= 0:
                raise APIError(504, f"request timed out after {self.app[CONFIG].request_timeout:g}s",
                               code="timeout")
            try:
                async with asyncio.timeout(min(remaining, self._poll_s)):
                    return await self._queue.get()
            except TimeoutError:
                await self._check_holders()
                await self._check_queued_model()

    async def _check_holders(self) -> None:
        holders = {w for job, w in self._holders.items() if not self._by_job[job].finished}
        if not holders or self.app[REDIS_WATCH].settling:  # just restarted: workers re-registering
            return
        try:
            alive = {w.worker_id for w in await self.app[WORKER_REGISTRY].workers()}
        except redis.RedisError:
            return  # Redis down says nothing about the worker; the deadline still bounds the wait
        dead = holders - alive
        if not dead:
            return
        lost = [c for c in self.choices if not c.finished and self._holders.get(c.job_id) in dead]
        if self._requeues < MAX_REQUEUES and all(replayable(self._job(c)) for c in lost):
            ours = await self._claim_reruns(lost)
            if ours is not None and (not ours or await self._requeue(ours)):
                log.warning("request %s (client id %s): decode worker %s stopped; %d job(s) queued again, %d by "
                            "their prefill worker", self.request_id, self.client_request_id, ", ".join(sorted(dead)),
                            len(ours), len(lost) - len(ours))
                return
        raise APIError(503, f"the worker serving this request stopped ({', '.join(sorted(dead))})",
                       code="worker_lost", headers={"Retry-After": str(self.app[CONFIG].retry_after_s)})

    async def _claim_reruns(self, lost: list[ChoiceState]) -> list[ChoiceState] | None:
        """The jobs whose re-run is ours (shared/wire/rerun.py); the others' prefill worker saw their decode
        worker die before it acked them and runs them again itself: forget their dead holder and wait for
        the re-run's events. None when Redis does not answer."""
        ours = []
        try:
            for choice in lost:
                holder = self._holders[choice.job_id]
                if await rerun.claim_async(self.app[REDIS], choice.job_id, holder, self.deadline, "gateway"):
                    ours.append(choice)
                else:
                    del self._holders[choice.job_id]
        except redis.RedisError as exc:
            redis_failed(self.app, exc)
            return None
        if len(ours) < len(lost):
            self._requeues += 1  # a re-run all the same: a second death of the request's holder fails it
        return ours

    async def _requeue(self, lost: list[ChoiceState]) -> bool:
        """Queue the jobs a dead decode worker held again, from their prompt: its KV died with it, and a
        re-run repeats a greedy or seeded text exactly, so the client keeps what it has and gets the rest
        (choice.py skips what it already has). False when Redis does not take them."""
        self._requeues += 1
        config = self.app[CONFIG]
        pipe = self.app[REDIS].pipeline(transaction=False)
        now = time.time()  # before the XADD, as in _submit
        for choice in lost:
            del self._holders[choice.job_id]
            self._enqueued[choice.job_id].append(now)
            pipe.xadd(self._stream, {keys.JOB_FIELD: encode(self._job(choice))}, maxlen=config.stream_maxlen,
                      approximate=True)
        try:
            await pipe.execute()
        except redis.RedisError as exc:
            redis_failed(self.app, exc)
            return False
        return True

    async def _check_queued_model(self) -> None:
        queued = self._queued
        if queued is None or not queued.jobs or self.app[REDIS_WATCH].settling:
            return  # every job heard from: its model is loaded somewhere
        try:
            await self._reload.check()
        except redis.RedisError:
            return  # Redis down: nothing could load it now; the deadline still bounds the wait

    async def __aiter__(self) -> AsyncIterator[ChoiceDelta]:
        pending = {c.job_id for c in self.choices}
        while pending:
            event = await self._next_event()
            if self._queued is not None:
                self._queued.heard(event.request_id)  # a worker has it: it is out of Redis
            choice = self._by_job.get(event.request_id)
            if choice is None or choice.finished:
                continue  # a late event after a stop string or a duplicate delivery
            if event.worker_id:
                self._holders[choice.job_id] = event.worker_id
            if not (event.token_ids or event.finish_reason or event.error or event.prompt_logprobs):
                continue  # a decode worker announcing it holds the request: nothing to stream
            had_tokens = bool(choice.token_ids)
            delta = choice.receive(event)
            if delta is None:
                continue
            # one stamp for every series that reads this delta, so the TTFT histograms and the stage split
            # agree exactly; observed now, not when the request ends, so a scrape mid-stream counts it
            now = time.time()
            metrics = self.app[METRICS]
            if self.first_token_at is None and delta.token_ids:
                self.first_token_at = now
                if self._whole_request:
                    metrics.ttft.labels(self.model_name).observe(max(now - self.arrival, 0.0))
            # the choice's first token: on ``event`` (output index 0, the one stamped; later ones wait for it)
            if delta.token_ids and not had_tokens:
                metrics.ttft_stages.observe(self.model_name, self.arrival, self._enqueued[choice.job_id],
                                            event.first_token_times, now, event.fetch_asked)
            metrics.vllm.delta(self, choice, len(delta.token_ids), now)
            if choice.finished:
                pending.discard(choice.job_id)
                self.app[DISPATCHER].unregister([choice.job_id])
                if not choice.worker_finished:  # a stop string ended it here; the worker is still going
                    spawn(self.app, publish_abort(self.app, [choice.job_id], "stop string"))
                if choice.finish_reason == "error":
                    raise compile_error(choice.error, self.prepared.constraint_param) or APIError(
                        500, f"worker error: {choice.error or 'unknown'}", code="worker_error")
            yield delta
