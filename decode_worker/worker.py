"""Decode worker main loop.

Lifecycle of one request here:
  1. A prefill worker asks for room (HandoffRequest); the receiver allocates blocks or refuses.
  2. KV frames arrive, are checked and copied into those blocks; the request joins the running batch
     with its prompt already computed and the prefill's first token as output 0; the ack goes back.
  3. Every step (continuous batching with everything else running) produces one token per request;
     one TokenBatch per gateway carries them.
  4. A stop condition ends it; so does the worker's Lifecycle (shared/worker/lifecycle.py) on an abort
     published by the gateway, the job's deadline, or the death of its gateway (its liveness key lapsed,
     or it stopped reading its events); either way its blocks are free within that step.

SIGTERM drains: no new grants (prefill workers go elsewhere), KV already granted is still taken, the
running batch finishes (up to the drain timeout), and what is left ends with an error event so no
client waits on a worker that is gone (``_abandon``).

Several models: one ROUTER socket takes every instance's handoffs (the header names the instance) and
one step runs each instance's engine in turn. A draining instance (a swap's old version) keeps taking
KV until no prefill worker holds it any more, then finishes its running requests and leaves.
"""

import logging
import math
import os
import time
from pathlib import Path

import redis
import zmq

from kvrelay.decode_worker.receiver import HandoffReceiver
from kvrelay.shared.config.worker import WorkerConfig
from kvrelay.shared.handoff.frames import max_message_bytes
from kvrelay.shared.wire import zmq_auth
from kvrelay.shared.wire.handoff import KVHeader
from kvrelay.shared.wire.protocol import TokenEvent
from kvrelay.shared.wire.zmq_auth import CurveKeys
from kvrelay.shared.worker.directory import live_workers
from kvrelay.shared.worker.lifecycle import InFlight, Lifecycle, engine_request
from kvrelay.shared.worker.model_slot import ModelSlot
from kvrelay.shared.worker.runtime import WorkerRuntime
from kvrelay.shared.worker.token_event import token_event

log = logging.getLogger(__name__)

LIVE_ASKERS_CACHE_S = 1.0  # how stale our view of which prefill workers heartbeat may be
# For tests only, never set in a deployment: a file path here makes the worker, once it has told the gateway
# it holds a request and before its ack leaves for the prefill worker, create that file and stop, so a test
# can kill -9 it in exactly that window (tests/e2e/test_rerun_once.py).
TEST_HOLD_BEFORE_ACK_ENV = "KVRELAY_TEST_HOLD_BEFORE_ACK"


class DecodeWorker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.runtime = WorkerRuntime(config, receives_kv=True)
        self.sock, self.addr = bind_router(self.runtime.ctx, config.host, config.port, self._max_frame(),
                                           config.advertise_host, curve=self.runtime.curve, io_thread=0)
        self.bulk = None  # (plain socket, address) each, where frames come MAC'd; without, on self.sock with CRCs
        if self.runtime.curve is not None and not config.encrypt_kv_frames:
            ports = [config.kv_frames_port + i if config.kv_frames_port else 0 for i in range(config.kv_frame_streams)]
            # a thread each (the context has one a stream besides thread 0): the least busy one, which libzmq picks
            # by default, is decided as each connection opens, and a sender's come all at once, before any is busy
            self.bulk = [bind_router(self.runtime.ctx, config.host, port, self._max_frame(), config.advertise_host,
                                     curve=None, io_thread=1 + i) for i, port in enumerate(ports)]
        self.receiver = HandoffReceiver(self.sock, self._core_for, config.handoff_timeout_s,
                                        max_per_peer=config.max_handoffs_per_peer, asker_alive=self._asker_alive,
                                        bulk=self.bulk)
        self.receiver.quota.on_wait, self.receiver.quota.on_grant = self._quota_wait, self._quota_grant
        self.receiver.held.on_end = self._held_ask_ended
        self.receiver.on_granted = self.runtime.events.dial
        self._live_askers: tuple[float, set[str]] = (0.0, set())
        self.inflight = Lifecycle(self.runtime, worker_id=config.worker_id)

    def _max_frame(self) -> int:
        """A KV frame holds at most ~4 MiB of layers, or one layer of the longest prompt; bigger is hostile.
        Models loaded later are bounded by the worker's KV pool: no prompt can need more than all of it."""
        pool = self.runtime.host.pool
        bound = pool.nbytes + (1 << 20) if pool is not None else 0
        for slot in self.runtime.slots.values():
            kv = slot.core.kv
            blocks = math.ceil(slot.core.max_model_len / kv.block_size)
            bound = max(bound, max_message_bytes(kv.kv_cache, blocks, kv.num_kv_heads))
        return bound

    def _core_for(self, instance: str):
        slot = self.runtime.slots.get(instance)
        if slot is None or (slot.state == "draining" and not self._prefill_holds(instance)):
            return None  # a draining instance takes KV only while some prefill worker may still send it
        return slot.core

    def run(self) -> None:
        self.runtime.start(self.addr, hooks=self)
        try:
            self.runtime.serve_forever(self.step, busy=lambda: bool(self.inflight) or self.receiver.busy,
                                       abandon=self._abandon)
        finally:
            self.sock.close(linger=0)
            for sock, _ in self.bulk or ():
                sock.close(linger=0)

    # -- RoleHooks ----------------------------------------------------------------------------------
    def attach(self, slot: ModelSlot) -> None:
        if slot.metrics is not None:
            slot.metrics.quota_waiting = lambda instance=slot.instance: self.receiver.quota.waiting(instance)

    def _metrics(self, model: str):
        slot = self.runtime.slots.get(model)
        return None if slot is None else slot.metrics

    def _quota_wait(self, model: str, tenant: str) -> None:
        if (metrics := self._metrics(model)) is not None:
            metrics.quota.waited(tenant)

    def _quota_grant(self, model: str, tenant: str, blocks_held: int) -> None:
        if (metrics := self._metrics(model)) is not None:
            metrics.quota.granted(tenant, blocks_held)

    def _held_ask_ended(self, model: str, outcome: str, held_s: float) -> None:
        if (metrics := self._metrics(model)) is not None:
            metrics.held_asks.ended(outcome, held_s)

    def detach(self, slot: ModelSlot) -> None:
        self.receiver.forget_model(slot.instance)

    def idle(self, slot: ModelSlot) -> bool:
        return (not slot.core.has_unfinished() and not self.receiver.has_model(slot.instance)
                and not self.inflight.holds(slot.instance))

    def may_unload(self, slot: ModelSlot) -> bool:
        return self.idle(slot) and not self._prefill_holds(slot.instance)

    def busy(self, slot: ModelSlot) -> bool:
        # a prefill worker still holding it may hand us its KV: the same bound as any drain
        return not self.may_unload(slot)

    def _asker_alive(self, worker_id: str) -> bool:
        """Does this prefill worker still heartbeat? Asked only for grants past their TTL, so Redis is read
        at most once a LIVE_ASKERS_CACHE_S, and only while some grant is overdue."""
        at, live = self._live_askers
        if time.monotonic() - at > LIVE_ASKERS_CACHE_S:
            try:
                live = {w.worker_id for w in live_workers(self.runtime.redis) if w.role == "prefill"}
            except redis.RedisError:
                return True  # cannot tell: keep its grant (MAX_GRANT_HOLD_S still bounds it)
            self._live_askers = (time.monotonic(), live)
        return worker_id in live

    def _prefill_holds(self, instance: str) -> bool:
        """Does a live prefill worker still hold this instance (and so may hand its KV to us)?"""
        try:
            workers = live_workers(self.runtime.redis)
        except redis.RedisError:
            return True  # cannot tell: keep it
        return any(w.role == "prefill" and instance in w.models for w in workers)

    # -- the loop -----------------------------------------------------------------------------------
    def step(self) -> None:
        self.receiver.accepting = not self.runtime.draining
        slots = list(self.runtime.slots.values())
        busy = any(s.core.has_unfinished() for s in slots)
        self.receiver.poll(0 if busy else 20, self._admit)
        self.inflight.sweep()
        for slot in slots:
            if not slot.core.has_unfinished():
                continue
            slot.touch()
            for out in slot.core.step():
                rec = self.inflight.get(out.request_id)
                if rec is None:
                    continue
                event = token_event(out, rec.sent, self.config.worker_id)
                if out.finished:
                    self.inflight.finish(rec.request_id, event)
                else:
                    self.inflight.send(rec, event)
        self.runtime.events.flush()

    def _admit(self, h: KVHeader) -> None:
        slot = self.runtime.slots[h.model]  # the receiver only grants instances we hold
        slot.note_request()
        job = h.job
        if self.inflight.unwanted(job):  # its client or its gateway left while the KV was on its way
            slot.core.kv.free(job.request_id)
            return  # acked all the same: the prefill side is done with it
        req = engine_request(slot, job)
        slot.core.add_remote_prefilled(req, h.first_token_id, h.num_cached_tokens)
        if slot.metrics is not None:
            slot.metrics.handoff_landed(h.nbytes, h.cached_blocks)
        self.inflight.track(InFlight(request_id=job.request_id, instance=job.model, reply_addr=job.reply_addr,
                                     deadline=job.deadline, arrival=job.arrival, max_tokens=req.max_tokens, sent=1))
        # Tell the gateway who holds the request now, before the ack lets the prefill side drop the job:
        # if this worker dies after the ack but before its first token event, the gateway still knows
        # whose heartbeat to watch and fails the stream instead of waiting out the request's deadline.
        self.runtime.events.add(job.reply_addr, TokenEvent(request_id=job.request_id, output_index=1,
                                                         worker_id=self.config.worker_id))
        self.runtime.events.flush()
        hold = os.environ.get(TEST_HOLD_BEFORE_ACK_ENV)
        if hold:
            _hold_for_test(hold)

    def _abandon(self) -> None:
        for rec in self.inflight.abandon():
            self.inflight.send(rec, self.inflight.end_event(rec, "error",
                                                            "decode worker shut down before the request finished"))
        for rid, grant in list(self.receiver.grants.items()):
            slot = self.runtime.slots.get(grant.model)
            if slot is not None:
                slot.core.kv.free(rid)  # KV never came; its prefill worker times the handoff out
        self.receiver.grants.clear()


def _hold_for_test(marker: str) -> None:
    log.warning("%s is set: holding before the ack until killed (a test's switch)", TEST_HOLD_BEFORE_ACK_ENV)
    Path(marker).touch()
    while True:
        time.sleep(1.0)


def bind_router(ctx: zmq.Context, host: str, port: int, max_msg_size: int, advertise_host: str | None = None, *,
                curve: CurveKeys | None, io_thread: int | None = None) -> tuple[zmq.Socket, str]:
    """A ROUTER socket on host:port (0 = ephemeral) and the address peers should dial; with ``curve``,
    only the deployment's processes get through its handshake. ``io_thread``: the one of the context's libzmq I/O
    threads that carries its connections (None: the least busy when each connects)."""
    if advertise_host is None and host in ("0.0.0.0", "*", "::"):
        raise ValueError("--host is a wildcard: set --advertise-host to an address prefill workers can reach")
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if io_thread is not None:
        sock.setsockopt(zmq.AFFINITY, 1 << io_thread)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
    zmq_auth.serve(sock, curve)
    if port:
        sock.bind(f"tcp://{host}:{port}")
    else:
        port = sock.bind_to_random_port(f"tcp://{host}")
    return sock, f"tcp://{advertise_host or host}:{port}"
