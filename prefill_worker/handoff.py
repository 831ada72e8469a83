"""The prefill side of the KV handoff: one state machine per transfer.

    GRANT_WAIT --grant(accepted)--> SENDING --header + KV out--> ACK_WAIT --ack(ok)--> DONE
        |  refused / timeout           | stalled past the timeout      | nack / timeout
        +-----> next decode worker     +-------------> FAILED <--------+
                (up to MAX_ATTEMPTS)

Early grants (SGLang-style pre-allocation): a prompt about to be prefilled asks before its KV exists,
so the KV can leave layer by layer while the prompt's last chunk is still computing:

    GRANT_WAIT --grant--> GRANTED --last chunk's forward--> STREAMING --first token--> SENDING -> ...
        | refused / no answer   | grant half its TTL old: HandoffCancel
        +------> PARKED <-------+     (asks again, as above, once the prompt is computed)

A grant that came too late for the forward is used as it would have been after the prefill.

The decode side allocates before it accepts (SGLang style), so a grant names the destination blocks.
SENDING (and STREAMING) take one of two paths:
- CUDA IPC, when the grant carries a handle (the decode worker shares our GPU): the blocks are copied
  device-to-device into the decode worker's cache on a side stream; once that copy's event completed,
  the header ("transport": "ipc") goes out. ZMQ carries control messages only.
- layer frames otherwise, or when mapping fails: frames of a few layers (~4 MB) as soon as they are
  staged into host memory and CRC'd, sent without blocking, and the header; a peer that stops reading
  fails this transfer at its deadline instead of stalling the worker's loop.
Streaming, the model's forward calls ``LayerStream`` after each decoder layer (shared/engine/model_runner.py),
and each group of layers is copied or staged on the side stream behind the compute stream as of that
layer, so those copies run while later layers compute; the header, which carries the first token,
goes out once it is sampled. Our blocks are released once nothing reads them any more (copy done /
staged), not at the ack; the job's XACK waits for the decode side's ack.
"""

import enum
import logging
import time
from dataclasses import dataclass, field

import zmq
from kvrelay.shared.handoff.cuda_ipc import DeviceCopy, IpcError, IpcPeers
from kvrelay.shared.handoff.frames import StagedKV, Waker, layout_of
from kvrelay.shared.wire.protocol import (
    MAX_MESSAGE_BYTES,
    HandoffAck,
    HandoffCancel,
    HandoffGrant,
    HandoffRequest,
    Job,
    KVHeader,
    KVLayers,
    WorkerInfo,
    decode_any,
    encode,
)
from kvrelay.shared.worker.directory import live_workers

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
NO_WORKER_RETRY_S = 0.2  # how often a transfer with no decode worker to ask (or none with room) looks again
WORKER_CACHE_S = 0.5
SEND_HWM = 256  # queued messages per decode worker; bounds what a stalled peer can make us hold


class State(enum.Enum):
    GRANT_WAIT = "grant_wait"
    GRANTED = "granted"  # early: blocks reserved on the decode side, the prompt not computed yet
    PARKED = "parked"  # early ask refused, unanswered or stale: asks again once computed
    STREAMING = "streaming"  # KV leaving while the last chunk computes; no first token yet
    SENDING = "sending"
    ACK_WAIT = "ack_wait"
    DONE = "done"
    FAILED = "failed"


@dataclass
class Transfer:
    job: Job
    entry_id: bytes
    first_token: int = -1
    first_logprob: float | None = None
    first_top: list | None = None
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    computed: bool = True  # the prompt's KV and first token exist (False: an early ask)
    grant: HandoffGrant | None = None  # held while GRANTED
    state: State = State.GRANT_WAIT
    target: str = ""
    tried: set[str] = field(default_factory=set)
    deadline: float = 0.0
    reason: str = ""
    nbytes: int = 0
    started: float = field(default_factory=time.perf_counter)
    granted: float = 0.0  # perf_counter stamps of the phases, for logs and the handoff benchmark
    sent: float = 0.0
    ended: float = 0.0
    asked_at: float = 0.0  # monotonic time of the last HandoffRequest
    transport: str = ""  # "ipc" or "layers" once granted
    streamed: bool = False  # the KV left layer by layer during the prompt's last chunk
    sender: DeviceCopy | StagedKV | None = None
    header: KVHeader | None = None
    header_sent: bool = False
    next_group: int = 0
    holds_source: bool = False  # our prefill blocks are still held for this transfer


class HandoffManager:
    def __init__(self, ctx: zmq.Context, runtime, timeout_s: float, workers=None, core_for=None):
        """``workers()`` lists the candidate decode workers; by default the live ones registered in Redis.
        ``core_for(model)`` is the engine holding that model instance's KV (default: ``runtime.core``)."""
        self.ctx = ctx
        self.runtime = runtime
        self.core_for = core_for or (lambda model: runtime.core)
        self.timeout_s = timeout_s
        self.sockets: dict[str, zmq.Socket] = {}
        self.poller = zmq.Poller()
        self.waker = Waker()  # staged layers wake poll(), so they go out at once even when we are idle
        self.poller.register(self.waker.fd, zmq.POLLIN)
        self.transfers: dict[str, Transfer] = {}
        self._list_workers = workers or self._load_workers
        self._workers: list[WorkerInfo] = []
        self._workers_at = 0.0
        self.device_uuid: str | None = None  # of the GPU our KV lives on, once known; "" turns IPC off
        self._ipc: dict[str, IpcPeers] = {}  # model instance -> its mappings of decode workers' caches
        self._ipc_refused: set[str] = set()

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close(linger=0)
        self.waker.close()
        for peers in self._ipc.values():
            peers.mapped.clear()  # unmap: the decode workers' IPC reference counts drop back

    @property
    def busy(self) -> bool:
        return bool(self.transfers)

    def has_model(self, model: str) -> bool:
        return any(t.job.model == model for t in self.transfers.values())

    def forget_model(self, model: str) -> None:
        """The instance was unloaded here: drop our mappings of decode workers' caches for it."""
        peers = self._ipc.pop(model, None)
        if peers is not None:
            peers.mapped.clear()

    def _peers(self, model: str, kv) -> IpcPeers:
        peers = self._ipc.get(model)
        if peers is None:
            peers = self._ipc[model] = IpcPeers(kv)
            if self.device_uuid is None:
                self.device_uuid = peers.uuid
        return peers

    def start(self, t: Transfer) -> None:
        """Hand off a prompt whose prefill finished (its blocks held by the engine)."""
        self.transfers[t.job.request_id] = t
        t.holds_source = t.computed
        self._send_request(t)

    def start_early(self, job: Job, entry_id: bytes) -> None:
        """Ask for a grant before the prompt is prefilled, so its KV can stream during the last chunk."""
        self.start(Transfer(job=job, entry_id=entry_id, computed=False))

    def complete(self, request_id: str, first_token: int, first_logprob: float | None, first_top: list | None,
                 num_cached_tokens: int) -> bool:
        """The prefill of an early transfer's prompt finished: send the rest. False if there is none."""
        t = self.transfers.get(request_id)
        if t is None or t.computed:
            return False
        t.first_token, t.first_logprob, t.first_top = first_token, first_logprob, first_top
        t.num_cached_tokens, t.computed, t.holds_source = num_cached_tokens, True, True
        t.started = time.perf_counter()  # the handoff's budget and its measured time start now
        if t.state is State.STREAMING:
            t.header = self._header(t, self.core_for(t.job.model).runner.kv_cache, t.grant.block_ids)
            t.state = State.SENDING
            self._pump(t)
        elif t.state is State.GRANTED:
            if self._fresh(t):
                self._on_grant(t, t.grant)
            else:
                self._cancel_grant(t, "the grant went stale while the prompt waited")
                self._send_request(t)
        elif t.state is State.PARKED:
            t.tried.clear()
            self._send_request(t)
        return True  # GRANT_WAIT: the grant, when it comes, is used at once

    def cancel(self, request_id: str) -> Transfer | None:
        t = self.transfers.pop(request_id, None)
        if t is not None:
            if t.target and t.state in (State.GRANT_WAIT, State.GRANTED, State.STREAMING, State.SENDING):
                self._cancel_grant(t, "cancelled by the prefill worker")
            self._release_source(t, wait=True)
        return t

    def stream_for(self, instance: str) -> "LayerStream":
        return LayerStream(self, instance)

    def poll(self, timeout_ms: int = 0) -> list[Transfer]:
        """Advance every transfer; return those that reached DONE or FAILED."""
        for sock, _ in self.poller.poll(timeout_ms):
            if sock == self.waker.fd:
                self.waker.drain()
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._on_reply(frames)
        now = time.monotonic()
        for t in list(self.transfers.values()):
            if t.state in (State.SENDING, State.STREAMING):
                self._pump(t)
            if not t.computed and t.state in (State.GRANT_WAIT, State.GRANTED):
                if t.state is State.GRANTED and not self._fresh(t):  # the prompt is still queued
                    self._cancel_grant(t, "the prompt is still waiting for its prefill")
                    t.state = State.PARKED
                elif t.state is State.GRANT_WAIT and now > t.deadline:
                    t.state = State.PARKED  # no answer: not worth more asks before the prefill
                continue
            if t.state is State.GRANT_WAIT and not t.target and now > t.deadline:
                self._send_request(t)  # waiting for a decode worker to register (see _send_request)
            elif t.state in (State.GRANT_WAIT, State.STREAMING, State.SENDING, State.ACK_WAIT) and now > t.deadline:
                what = "take the KV" if t.state in (State.SENDING, State.STREAMING) else "answer"
                self._retry(t, f"decode worker {t.target} did not {what} within {self.timeout_s}s")
        ended = [t for t in self.transfers.values() if t.state in (State.DONE, State.FAILED)]
        for t in ended:
            t.ended = time.perf_counter()
            del self.transfers[t.job.request_id]
        return ended

    # -- transitions ----------------------------------------------------------------------------
    def _send_request(self, t: Transfer, after: str = "") -> None:
        target = self._pick_decode_worker(t.tried, t.job.model)
        if target is None and not t.computed:
            t.target, t.state = "", State.PARKED
            return
        if target is None and self._in_budget(t):
            # None registered (Redis just restarted, the only decode worker is being replaced) or every
            # one refused for lack of room: that is backpressure, not failure. Keep the KV and ask them
            # all again shortly, within the handoff timeout.
            t.tried.clear()
            t.target, t.state, t.deadline = "", State.GRANT_WAIT, time.monotonic() + NO_WORKER_RETRY_S
            return
        if target is None:
            self._fail(t, f"{after}; no other decode worker to try" if after else "no decode worker for this model")
            return
        t.target, t.state = target.zmq_addr, State.GRANT_WAIT
        t.tried.add(target.worker_id)
        t.asked_at = time.monotonic()
        t.deadline = t.asked_at + self.timeout_s
        core = self.core_for(t.job.model)
        self._peers(t.job.model, core.runner.kv_cache)  # learn our GPU's uuid before offering it
        req = HandoffRequest(request_id=t.job.request_id, model=t.job.model, num_tokens=len(t.job.prompt_token_ids),
                             block_size=core.runner.block_size, prefill_addr=self.runtime.zmq_addr,
                             device_uuid=self.device_uuid or "", requester=self.runtime.config.worker_id)
        if not self._send(t, [encode(req)]):
            self._retry(t, f"decode worker {t.target} is not reading its requests")

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
            if msg.accepted and not t.computed:
                t.grant, t.state = msg, State.GRANTED
            elif msg.accepted:
                self._on_grant(t, msg)
            elif not t.computed:
                t.state = State.PARKED  # e.g. its batch is full now; by the time we are done it may not be
            else:
                self._retry(t, f"decode worker refused: {msg.reason}")
        elif isinstance(msg, HandoffAck) and t.state is State.ACK_WAIT:
            if msg.ok:
                t.state = State.DONE
            else:
                self._fail(t, f"decode worker rejected the KV: {msg.reason}")

    def _on_grant(self, t: Transfer, grant: HandoffGrant) -> None:
        core = self.core_for(t.job.model)
        src_blocks = core.block_manager.block_ids(t.job.request_id)[: len(grant.block_ids)]
        if len(src_blocks) != len(grant.block_ids):
            self._fail(t, f"grant has {len(grant.block_ids)} blocks, the prompt uses {len(src_blocks)}")
            return
        kv = core.runner.kv_cache
        t.granted = time.perf_counter()
        t.state, t.deadline, t.next_group, t.header_sent = State.SENDING, time.monotonic() + self.timeout_s, 0, False
        t.sender, t.transport = None, "layers"
        # IPC writes straight into the decode worker's blocks, so it must land well inside the grant's
        # lifetime (the decode side quarantines expired IPC grants for as long again)
        if grant.ipc is not None and self.device_uuid and time.monotonic() - t.asked_at < grant.ttl_s / 2:
            try:
                dst = self._peers(t.job.model, kv).open(t.target, grant.ipc)
                t.sender = DeviceCopy(kv, src_blocks, dst, grant.block_ids)
                t.transport = "ipc"
                # the copy is device-local (~0.15 ms for 268 MB) and the compute stream is idle between
                # steps, where grants are handled: waiting for it beats waiting for the next poll
                t.sender.wait()
            except (IpcError, RuntimeError) as exc:  # torch reports CUDA refusals as RuntimeError
                self._ipc_unavailable(t, exc)
        if t.sender is None:
            t.sender = StagedKV(kv, src_blocks, on_ready=self.waker.wake)
        t.header = self._header(t, kv, grant.block_ids)
        self._pump(t)

    def _header(self, t: Transfer, kv, block_ids: list[int]) -> KVHeader:
        t.nbytes = t.sender.nbytes if t.transport == "ipc" else t.sender.layer_nbytes * kv.shape[0]
        job = t.job
        return KVHeader(
            request_id=job.request_id, model=job.model, **layout_of(kv), num_blocks=len(block_ids),
            block_ids=block_ids, num_frames=0 if t.transport == "ipc" else kv.shape[0], nbytes=t.nbytes,
            checksum=0, prompt_token_ids=job.prompt_token_ids, first_token_id=t.first_token,
            first_logprob=t.first_logprob, first_top_logprobs=t.first_top, prompt_logprobs=None,
            num_cached_tokens=t.num_cached_tokens, sampling=job.sampling, tenant=job.tenant, priority=job.priority,
            reply_addr=job.reply_addr, deadline=job.deadline, arrival=job.arrival, cache_salt=job.cache_salt,
            transport=t.transport,
        )

    def _begin_stream(self, request_id: str, instance: str, blocks: list[int]):
        """The forward about to run computes the last chunk of ``request_id``'s prompt: if it holds a
        fresh grant, start streaming it and return it (its sender stages or copies layers as written)."""
        t = self.transfers.get(request_id)
        if t is None or t.state is not State.GRANTED or t.job.model != instance or not self._fresh(t):
            return None
        grant, kv = t.grant, self.core_for(instance).runner.kv_cache
        src = blocks[: len(grant.block_ids)]
        if len(src) != len(grant.block_ids):
            return None  # complete() sends it the plain way, which reports the mismatch
        t.sender, t.transport = None, "layers"
        if grant.ipc is not None and self.device_uuid:
            try:
                dst = self._peers(instance, kv).open(t.target, grant.ipc)
                t.sender, t.transport = DeviceCopy(kv, src, dst, grant.block_ids, deferred=True), "ipc"
            except (IpcError, RuntimeError) as exc:
                self._ipc_unavailable(t, exc)
        if t.sender is None:
            t.sender = StagedKV(kv, src, on_ready=self.waker.wake, deferred=True)
        t.granted, t.next_group, t.header_sent = time.perf_counter(), 0, False
        t.state, t.deadline, t.streamed = State.STREAMING, time.monotonic() + self.timeout_s, True
        return t

    def _ipc_unavailable(self, t: Transfer, exc: Exception) -> None:
        if t.target not in self._ipc_refused:  # once per decode worker: it stays refused
            self._ipc_refused.add(t.target)
            log.warning("CUDA IPC to %s unavailable, sending frames: %s", t.target, exc)
        t.sender, t.transport = None, "layers"

    def _fresh(self, t: Transfer) -> bool:
        """IPC writes, and streamed layers, must land well inside the grant's lifetime (the decode side
        quarantines expired IPC grants for as long again)."""
        return time.monotonic() - t.asked_at < t.grant.ttl_s / 2

    def _cancel_grant(self, t: Transfer, reason: str) -> None:
        self._send(t, [encode(HandoffCancel(request_id=t.job.request_id, reason=reason))])
        t.grant = None

    def _pump(self, t: Transfer) -> None:
        """Move a SENDING (or STREAMING) transfer as far as it goes without blocking."""
        if t.state is State.STREAMING:
            if t.transport == "layers":
                self._send_groups(t)
            return  # no header before the first token is sampled
        if t.transport == "ipc":
            if not t.sender.done():
                return  # the header must not promise KV that has not landed yet
            self._release_source(t)
            if self._send(t, [encode(t.header)]):
                self._sent(t)
            return
        if not t.header_sent:
            t.header_sent = self._send(t, [encode(t.header)])
            if not t.header_sent:
                return
        if t.holds_source and t.sender.source_free():
            self._release_source(t)
        if self._send_groups(t):
            self._release_source(t)
            self._sent(t)

    def _send_groups(self, t: Transfer) -> bool:
        """Send the staged groups of layers not sent yet; True once all are out."""
        while t.next_group < t.sender.num_messages and t.sender.ready(t.next_group):
            frame, crcs = t.sender.result(t.next_group)
            msg = KVLayers(request_id=t.job.request_id, first=t.next_group * t.sender.per_message,
                           nbytes=t.sender.layer_nbytes, checksums=crcs)
            if not self._send(t, [encode(msg), frame]):
                return False  # the peer's queue is full: try again on the next poll, until the deadline
            t.next_group += 1
        return t.next_group == t.sender.num_messages

    def _sent(self, t: Transfer) -> None:
        t.sent = time.perf_counter()
        t.state, t.deadline = State.ACK_WAIT, time.monotonic() + self.timeout_s
        t.sender = None  # ZMQ keeps the frames it still has to send alive by itself

    def _retry(self, t: Transfer, reason: str) -> None:
        if t.state is not State.GRANT_WAIT or (len(t.tried) >= MAX_ATTEMPTS and not self._in_budget(t)):
            # once KV went out, the decode side may hold a half transfer: fail cleanly (it expires there)
            log.warning("handoff of %s: %s", t.job.request_id, reason)
            self._fail(t, reason)
            return
        log.debug("handoff of %s: %s; asking again", t.job.request_id, reason)  # under load: every 0.2 s
        self._send_request(t, after=reason)

    def _in_budget(self, t: Transfer) -> bool:
        """A transfer may keep looking for a decode worker with room until the handoff timeout."""
        return time.perf_counter() - t.started < self.timeout_s

    def _fail(self, t: Transfer, reason: str) -> None:
        self._release_source(t, wait=True)
        t.state, t.reason, t.sender = State.FAILED, reason, None

    def _release_source(self, t: Transfer, wait: bool = False) -> None:
        """Free our prefill blocks; with ``wait``, first let in-flight copies out of them finish (also
        when the engine, not us, frees them: a streamed prompt that ended at its first token)."""
        if wait and t.sender is not None:
            t.sender.wait() if isinstance(t.sender, DeviceCopy) else t.sender.wait_source()
        if not t.holds_source:
            return
        core = self.core_for(t.job.model)
        if core is not None:
            core.scheduler.release_held(t.job.request_id)
        t.holds_source = False

    # -- plumbing -------------------------------------------------------------------------------
    def _send(self, t: Transfer, parts: list) -> bool:
        """Queue one message for the transfer's decode worker; False when its queue is full."""
        try:
            self._socket(t.target).send_multipart(parts, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    def _socket(self, addr: str) -> zmq.Socket:
        sock = self.sockets.get(addr)
        if sock is None:
            sock = self.sockets[addr] = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # replies are control messages only
            sock.connect(addr)
            self.poller.register(sock, zmq.POLLIN)
        return sock

    def _pick_decode_worker(self, exclude: set[str], model: str) -> WorkerInfo | None:
        now = time.monotonic()
        if now - self._workers_at > WORKER_CACHE_S:
            self._workers_at, self._workers = now, self._list_workers()
            for peers in self._ipc.values():
                peers.retain({w.zmq_addr for w in self._workers})
        live = [w for w in self._workers
                if w.role == "decode" and model in w.models and w.worker_id not in exclude]
        # most free KV first, then the lightest batch: spreads load and avoids a grant refusal
        live.sort(key=lambda w: (-_free_kv(w, model), _load(w, model)))
        return live[0] if live else None

    def _load_workers(self) -> list[WorkerInfo]:
        return live_workers(self.runtime.redis)

class LayerStream:
    """What one model's runner calls around each forward (``ModelRunner.kv_stream``): ``begin`` with
    the requests whose prompt's last chunk the forward computes, ``layer_done`` after each decoder
    layer, ``end`` once the forward is queued. Transfers holding a fresh early grant stage or copy each
    group of layers as soon as the forward has written it."""

    def __init__(self, manager: HandoffManager, instance: str):
        self.manager, self.instance = manager, instance
        self.streaming: list[Transfer] = []  # this forward's

    def begin(self, finishing: list[tuple[str, list[int]]]) -> bool:
        """``finishing``: (request id, its block ids). True when any layer is worth reporting."""
        self.streaming = [t for rid, blocks in finishing
                          if (t := self.manager._begin_stream(rid, self.instance, blocks)) is not None]
        return bool(self.streaming)

    def layer_done(self, layer: int) -> None:
        for t in self.streaming:
            if t.state is State.STREAMING:
                t.sender.stage_through(layer)
                self.manager._pump(t)  # on the CPU the forward is synchronous: send what is staged now

    def end(self) -> None:
        """Whatever the forward wrote and no hook reported (a model without per-layer hooks)."""
        for t in self.streaming:
            if t.state is State.STREAMING:
                t.sender.stage_through(t.sender.num_layers - 1)
        self.streaming = []


def _free_kv(w: WorkerInfo, model: str) -> int:
    """Blocks the worker could give ``model`` now (its free ones plus what its shared pool could lend)."""
    inst = next((i for i in w.instances if i.instance == model), None)
    return w.free_blocks if inst is None else inst.kv_free_blocks


def _load(w: WorkerInfo, model: str) -> int:
    inst = next((i for i in w.instances if i.instance == model), None)
    return w.running + w.waiting if inst is None else inst.running + inst.waiting
