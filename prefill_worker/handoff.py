"""The prefill side of the KV handoff: one state machine per transfer.

    GRANT_WAIT --grant(accepted)--> ACK_WAIT --ack(ok)--> DONE
        |  refused / timeout             | nack / timeout
        +-----> next decode worker <-----+   (up to MAX_ATTEMPTS, then FAILED)

The decode side allocates before it accepts (SGLang style), so a grant names the destination blocks.
The KV is copied out of this worker's cache when the grant arrives, after which the prefill blocks are
free again; only the job's XACK waits for the decode side's ack.
"""

import enum
import logging
import time
from dataclasses import dataclass, field

import zmq

from shared import redis_keys as keys
from shared.kv_transfer import layout_of, pack_blocks
from shared.protocol import (HandoffAck, HandoffGrant, HandoffRequest, Job, KVHeader, WorkerInfo, decode,
                             decode_any, encode, kv_checksum)

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
NO_WORKER_RETRY_S = 0.2  # how often a transfer with no decode worker to ask looks again
WORKER_CACHE_S = 0.5


class State(enum.Enum):
    GRANT_WAIT = "grant_wait"
    ACK_WAIT = "ack_wait"
    DONE = "done"
    FAILED = "failed"


@dataclass
class Transfer:
    job: Job
    entry_id: bytes
    first_token: int
    first_logprob: float | None
    first_top: list | None
    prompt_logprobs: list | None
    num_cached_tokens: int
    state: State = State.GRANT_WAIT
    target: str = ""
    tried: set[str] = field(default_factory=set)
    deadline: float = 0.0
    reason: str = ""
    nbytes: int = 0
    started: float = field(default_factory=time.perf_counter)


class HandoffManager:
    def __init__(self, ctx: zmq.Context, runtime, timeout_s: float):
        self.ctx = ctx
        self.runtime = runtime
        self.timeout_s = timeout_s
        self.sockets: dict[str, zmq.Socket] = {}
        self.poller = zmq.Poller()
        self.transfers: dict[str, Transfer] = {}
        self._workers: list[WorkerInfo] = []
        self._workers_at = 0.0

    @property
    def busy(self) -> bool:
        return bool(self.transfers)

    def start(self, t: Transfer) -> None:
        self.transfers[t.job.request_id] = t
        self._send_request(t)

    def cancel(self, request_id: str) -> Transfer | None:
        t = self.transfers.pop(request_id, None)
        if t is not None and t.state is State.GRANT_WAIT:
            self.runtime.core.scheduler.release_held(request_id)
        return t

    def poll(self, timeout_ms: int = 0) -> list[Transfer]:
        """Advance every transfer; return those that reached DONE or FAILED."""
        if self.sockets:
            for sock, _ in self.poller.poll(timeout_ms):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_reply(frames)
        now = time.monotonic()
        for t in list(self.transfers.values()):
            if t.state is State.GRANT_WAIT and not t.target and now > t.deadline:
                self._send_request(t)  # waiting for a decode worker to register (see _send_request)
            elif t.state in (State.GRANT_WAIT, State.ACK_WAIT) and now > t.deadline:
                self._retry(t, f"decode worker {t.target} did not answer within {self.timeout_s}s")
        ended = [t for t in self.transfers.values() if t.state in (State.DONE, State.FAILED)]
        for t in ended:
            del self.transfers[t.job.request_id]
        return ended

    # -- transitions ----------------------------------------------------------------------------
    def _send_request(self, t: Transfer) -> None:
        target = self._pick_decode_worker(t.tried)
        if target is None and not t.tried and time.perf_counter() - t.started < self.timeout_s:
            # None registered yet (Redis just restarted, or the only decode worker is being replaced):
            # look again shortly, within the handoff timeout, rather than fail a request that can wait
            t.target, t.state, t.deadline = "", State.GRANT_WAIT, time.monotonic() + NO_WORKER_RETRY_S
            return
        if target is None:
            self._fail(t, "no decode worker available for this model")
            return
        t.target, t.state = target.zmq_addr, State.GRANT_WAIT
        t.tried.add(target.worker_id)
        t.deadline = time.monotonic() + self.timeout_s
        req = HandoffRequest(request_id=t.job.request_id, model=t.job.model, num_tokens=len(t.job.prompt_token_ids),
                             block_size=self.runtime.core.runner.block_size, prefill_addr=self.runtime.zmq_addr)
        self._socket(t.target).send(encode(req))

    def _on_reply(self, frames: list[bytes]) -> None:
        try:
            msg = decode_any(frames[0], HandoffGrant, HandoffAck)
        except ValueError as exc:
            log.warning("dropped a malformed handoff reply: %s", exc)
            return
        t = self.transfers.get(msg.request_id)
        if t is None:
            return  # a late reply for a transfer that already timed out or was cancelled
        if isinstance(msg, HandoffGrant) and t.state is State.GRANT_WAIT:
            if msg.accepted:
                self._send_kv(t, msg.block_ids)
            else:
                self._retry(t, f"decode worker refused: {msg.reason}")
        elif isinstance(msg, HandoffAck) and t.state is State.ACK_WAIT:
            if msg.ok:
                t.state = State.DONE
            else:
                self._fail(t, f"decode worker rejected the KV: {msg.reason}")

    def _send_kv(self, t: Transfer, dest_blocks: list[int]) -> None:
        core = self.runtime.core
        rid = t.job.request_id
        src_blocks = core.block_manager.block_ids(rid)[: len(dest_blocks)]
        if len(src_blocks) != len(dest_blocks):
            self._fail(t, f"grant has {len(dest_blocks)} blocks, the prompt uses {len(src_blocks)}")
            return
        frames = pack_blocks(core.runner.kv_cache, src_blocks)
        core.scheduler.release_held(rid)  # the KV is copied out; our blocks can serve others now
        t.nbytes = sum(f.nbytes for f in frames)
        job = t.job
        header = KVHeader(
            request_id=rid, model=job.model, **layout_of(core.runner.kv_cache), num_blocks=len(dest_blocks),
            block_ids=dest_blocks, num_frames=len(frames), nbytes=t.nbytes, checksum=kv_checksum(frames),
            prompt_token_ids=job.prompt_token_ids, first_token_id=t.first_token, first_logprob=t.first_logprob,
            first_top_logprobs=t.first_top, prompt_logprobs=None, num_cached_tokens=t.num_cached_tokens,
            sampling=job.sampling, tenant=job.tenant, priority=job.priority, reply_addr=job.reply_addr,
            deadline=job.deadline, arrival=job.arrival, cache_salt=job.cache_salt,
        )
        self._socket(t.target).send_multipart([encode(header), *frames], copy=False)
        t.state, t.deadline = State.ACK_WAIT, time.monotonic() + self.timeout_s

    def _retry(self, t: Transfer, reason: str) -> None:
        log.warning("handoff of %s: %s", t.job.request_id, reason)
        if t.state is State.ACK_WAIT or len(t.tried) >= MAX_ATTEMPTS:
            # after the KV left, our copy is gone: a retry would need a recompute, so fail cleanly
            self._fail(t, reason)
            return
        self._send_request(t)

    def _fail(self, t: Transfer, reason: str) -> None:
        if t.state is State.GRANT_WAIT:
            self.runtime.core.scheduler.release_held(t.job.request_id)
        t.state, t.reason = State.FAILED, reason

    # -- plumbing -------------------------------------------------------------------------------
    def _socket(self, addr: str) -> zmq.Socket:
        sock = self.sockets.get(addr)
        if sock is None:
            sock = self.sockets[addr] = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
            sock.connect(addr)
            self.poller.register(sock, zmq.POLLIN)
        return sock

    def _pick_decode_worker(self, exclude: set[str]) -> WorkerInfo | None:
        now = time.monotonic()
        if now - self._workers_at > WORKER_CACHE_S:
            self._workers_at, self._workers = now, self._load_workers()
        model = self.runtime.config.model_name
        live = [w for w in self._workers
                if w.role == "decode" and model in w.models and w.worker_id not in exclude]
        # most free KV first, then the lightest batch: spreads load and avoids a grant refusal
        live.sort(key=lambda w: (-w.free_blocks, w.running + w.waiting))
        return live[0] if live else None

    def _load_workers(self) -> list[WorkerInfo]:
        r = self.runtime.redis
        ids = r.smembers(keys.WORKERS_INDEX)
        raws = r.mget([keys.worker_key(i.decode()) for i in ids]) if ids else []
        workers = []
        for raw in raws:
            if raw is None:
                continue  # heartbeat expired: dead
            try:
                workers.append(decode(raw, WorkerInfo))
            except ValueError:
                continue
        return workers
