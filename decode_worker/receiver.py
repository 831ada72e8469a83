"""The decode side of the KV handoff: grants (blocks allocated before accepting), KV checked and
written into the granted blocks, and the ack that lets the prefill side XACK the job.

Per request: HandoffRequest -> GRANTED (blocks reserved, expiry armed; a CUDA IPC handle to our KV
cache offered when the asker shares our GPU) -> KVHeader, then by its transport:
  "ipc"    the sender already wrote the blocks and waited for the copy; the layout is checked -> ADMITTED
  "layers" KVLayers messages, one frame of a few layers each, CRC-checked and written by a pool thread
           as they come;
           all in -> ADMITTED; a bad layer, or none for the timeout -> blocks freed + nack
  "frames" every frame in the header's message, checked at once -> ADMITTED
A streamed "layers" transfer (the sender's prefill still computing) sends KVLayers first: GRANTED ->
RECEIVING on the first layer, sized against our own layout, and the header, which carries the first
token, comes last and must match that layout and the grant.
ADMITTED means in the running batch, and the ack goes back. A bad header -> blocks freed + nack.
HandoffCancel frees a grant (or a transfer's blocks) the sender gave up on.
A grant whose KV never arrives expires and its blocks return to the pool, except that blocks offered
through IPC stay quarantined for one more TTL: the asker may write them directly, and it only does so
within half the TTL of asking, so by the end of the quarantine no write can still land in them.
"""

import logging
import time
from dataclasses import dataclass

import zmq
from kvrelay.shared.handoff.cuda_ipc import IpcExporter
from kvrelay.shared.handoff.frames import LayerAssembler, Waker, check_frames, check_layout, unpack_blocks
from kvrelay.shared.wire.protocol import (
    HandoffAck,
    HandoffCancel,
    HandoffGrant,
    HandoffRequest,
    KVHeader,
    KVLayers,
    decode_any,
    encode,
)

log = logging.getLogger(__name__)


@dataclass
class Grant:
    model: str
    block_ids: list[int]
    num_tokens: int
    expires: float
    ipc: bool = False  # a CUDA IPC handle went out with it


@dataclass
class Incoming:
    """A "layers" transfer whose header arrived; its layers are still coming."""

    peer: bytes
    model: str
    block_ids: list[int]
    num_tokens: int
    header: KVHeader | None  # None while streamed layers come ahead of it
    assembler: LayerAssembler
    deadline: float


class HandoffReceiver:
    def __init__(self, sock: zmq.Socket, core, model_name: str, grant_ttl_s: float, core_for=None):
        """``core_for(model)``: the engine serving that model instance here, or None (default: ``core``
        serves ``model_name``). A worker hosting several models routes each request by its model."""
        self.sock = sock
        self.core_for = core_for or (lambda model: core if model == model_name else None)
        self.grant_ttl_s = grant_ttl_s
        self.grants: dict[str, Grant] = {}
        self.incoming: dict[str, Incoming] = {}
        self.quarantine: list[tuple[float, str, str]] = []  # (release time, model, block-manager owner key)
        self._quarantined = 0
        self.exporters: dict[str, IpcExporter] = {}  # model -> the handle to its KV cache
        self.waker = Waker()  # finished layer writes wake poll(), so the ack goes out at once
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(self.waker.fd, zmq.POLLIN)
        self.bytes_received = 0
        self.accepting = True  # False while the worker drains: no new grants, granted KV still taken

    @property
    def busy(self) -> bool:
        """KV granted or arriving: a draining worker waits for it."""
        return bool(self.grants or self.incoming)

    def has_model(self, model: str) -> bool:
        return (any(g.model == model for g in self.grants.values())
                or any(i.model == model for i in self.incoming.values())
                or any(q[1] == model for q in self.quarantine))

    def forget_model(self, model: str) -> None:
        self.exporters.pop(model, None)

    def poll(self, timeout_ms: int, admit) -> int:
        """Handle every waiting message; ``admit(header)`` adds an arrived request to the batch.
        Returns the number of messages handled."""
        handled = 0
        ready = dict(self.poller.poll(timeout_ms))
        if self.waker.fd in ready:
            self.waker.drain()
        if self.sock in ready:
            while True:
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                handled += 1
                self._on_message(frames, admit)
        self._advance(admit)
        self._expire()
        return handled

    def _on_message(self, frames: list, admit) -> None:
        if len(frames) < 2:
            log.warning("dropped a handoff message without a body")
            return
        peer, payload = frames[0].bytes, frames[2:]
        try:
            msg = decode_any(frames[1].bytes, HandoffRequest, KVHeader, KVLayers, HandoffCancel)
        except ValueError as exc:
            log.warning("dropped a malformed handoff message: %s", exc)
            return
        if isinstance(msg, HandoffRequest):
            self._reply(peer, self._grant(msg))
        elif isinstance(msg, HandoffCancel):
            self._on_cancel(peer, msg)
        elif isinstance(msg, KVLayers):
            self._on_layer(peer, msg, payload)
        else:
            self._on_header(peer, msg, payload, admit)

    def _grant(self, req: HandoffRequest) -> HandoffGrant:
        def refuse(reason: str) -> HandoffGrant:
            return HandoffGrant(request_id=req.request_id, accepted=False, reason=reason)

        if not self.accepting:
            return refuse("decode worker is draining")
        core = self.core_for(req.model)
        if core is None:
            return refuse(f"model {req.model!r} is not served here")
        if req.block_size != core.block_manager.block_size:
            return refuse(f"block size {req.block_size} != {core.block_manager.block_size}")
        if self._holds(core, req.request_id):
            return refuse("duplicate request id")  # a reclaimed job must never stream twice
        # KV never came (or stopped coming) for an earlier grant: its prefill worker died and a peer
        # reclaimed the job. The newer asker wins; a late KV for the old grant is refused as misaddressed
        if req.request_id in self.incoming:
            self._abort_incoming(req.request_id, "superseded by a newer request for the same id")
        if req.request_id in self.grants:
            self._release_grant(req.request_id)
        sched = core.scheduler
        pending = sum(1 for g in self.grants.values() if g.model == req.model) + sum(
            1 for i in self.incoming.values() if i.model == req.model)
        if sched.num_running + pending >= core.config.scheduler.max_num_seqs:
            return refuse("running batch is full (max_num_seqs)")
        if req.num_tokens >= core.max_model_len:
            return refuse(f"{req.num_tokens} tokens exceed max_model_len {core.max_model_len}")
        blocks = core.block_manager.allocate_for_tokens(req.request_id, req.num_tokens)
        if blocks is None:
            return refuse("no free KV blocks")
        exporter = self.exporters.get(req.model)
        if exporter is None:
            exporter = self.exporters[req.model] = IpcExporter(core.runner.kv_cache)
        ipc = exporter.offer(req.requester, req.device_uuid)
        self.grants[req.request_id] = Grant(req.model, blocks, req.num_tokens, time.monotonic() + self.grant_ttl_s,
                                            ipc=ipc is not None)
        return HandoffGrant(request_id=req.request_id, accepted=True, block_ids=blocks, ipc=ipc,
                            ttl_s=self.grant_ttl_s)

    def _on_header(self, peer: bytes, header: KVHeader, payload: list, admit) -> None:
        rid = header.request_id
        inc = self.incoming.get(rid)
        if inc is not None and inc.header is None and inc.peer == peer:
            return self._on_late_header(inc, header, payload)
        grant = self.grants.get(rid)
        if grant is None:
            return self._nack(peer, rid, "no grant for this request (expired or never asked)")
        if header.block_ids != grant.block_ids or header.model != grant.model:
            # a stale sender of a superseded grant: refuse it without touching the live grant
            return self._nack(peer, rid, "KV addressed to blocks that were not granted")
        del self.grants[rid]  # from here the sender is done writing blocks itself: free them on failure
        core = self.core_for(grant.model)
        kv = core.runner.kv_cache
        try:
            if len(header.prompt_token_ids) != grant.num_tokens:
                raise ValueError("prompt length differs from the granted one")
            if header.transport == "frames":
                frames = [f.buffer for f in payload]
                check_frames(kv, header, frames)
                unpack_blocks(kv, grant.block_ids, frames)
            elif payload:
                raise ValueError(f"a {header.transport!r} header carries no frames")
            elif header.transport == "layers":
                check_layout(kv, header)
                self._receive(peer, rid, grant, header)
                return
            else:
                if not grant.ipc:
                    raise ValueError("KV claims to be written through CUDA IPC, which this grant did not offer")
                check_layout(kv, header)
        except ValueError as exc:
            core.block_manager.free(rid)
            log.warning("rejected KV for %s: %s", rid, exc)
            return self._nack(peer, rid, str(exc))
        self._land(peer, header, admit)

    def _receive(self, peer: bytes, rid: str, grant: Grant, header: KVHeader | None) -> Incoming:
        kv = self.core_for(grant.model).runner.kv_cache
        inc = self.incoming[rid] = Incoming(peer, grant.model, grant.block_ids, grant.num_tokens, header,
                                            LayerAssembler(kv, grant.block_ids, on_done=self.waker.wake),
                                            time.monotonic() + self.grant_ttl_s)
        return inc

    def _on_late_header(self, inc: Incoming, header: KVHeader, payload: list) -> None:
        """The header of a transfer whose layers streamed ahead of it."""
        rid = header.request_id
        try:
            if header.block_ids != inc.block_ids or header.model != inc.model:
                raise ValueError("KV addressed to blocks that were not granted")
            if header.transport != "layers" or payload:
                raise ValueError(f"a {header.transport!r} header after streamed layers")
            if len(header.prompt_token_ids) != inc.num_tokens:
                raise ValueError("prompt length differs from the granted one")
            check_layout(self.core_for(inc.model).runner.kv_cache, header)
        except ValueError as exc:
            return self._abort_incoming(rid, str(exc))
        inc.header = header  # _advance lands it once every layer is written

    def _on_cancel(self, peer: bytes, msg: HandoffCancel) -> None:
        rid = msg.request_id
        inc = self.incoming.get(rid)
        if inc is not None and inc.peer == peer:
            inc = self.incoming.pop(rid)
            inc.assembler.abandon()
            self.core_for(inc.model).block_manager.free(rid)
        elif rid in self.grants:
            self._release_grant(rid)
        log.debug("handoff of %s cancelled by its sender: %s", rid, msg.reason)

    def _on_layer(self, peer: bytes, msg: KVLayers, payload: list) -> None:
        inc = self.incoming.get(msg.request_id)
        grant = self.grants.get(msg.request_id)
        if inc is None and grant is not None:
            # streamed ahead of the header: the blocks are the sender's to fill from here on
            del self.grants[msg.request_id]
            inc = self._receive(peer, msg.request_id, grant, None)
        if inc is None or inc.peer != peer:
            return  # the rest of a transfer already failed or superseded; its sender got the nack
        try:
            inc.assembler.add(msg, [f.buffer for f in payload])
        except ValueError as exc:
            self._abort_incoming(msg.request_id, str(exc))

    def _advance(self, admit) -> None:
        for rid, inc in list(self.incoming.items()):
            error = inc.assembler.error()
            if error is not None:
                self._abort_incoming(rid, str(error))
            elif inc.assembler.complete and inc.header is not None:
                inc.assembler.finish()
                del self.incoming[rid]
                self._land(inc.peer, inc.header, admit)

    def _land(self, peer: bytes, header: KVHeader, admit) -> None:
        """The KV sits checked in the granted blocks: join the batch and ack."""
        self.bytes_received += header.nbytes
        try:
            admit(header)
        except ValueError as exc:  # the request itself is invalid here (e.g. a smaller context)
            self.core_for(header.model).block_manager.free(header.request_id)
            return self._nack(peer, header.request_id, str(exc))
        self._reply(peer, HandoffAck(request_id=header.request_id, ok=True))

    def _abort_incoming(self, rid: str, reason: str) -> None:
        inc = self.incoming.pop(rid)
        inc.assembler.abandon()  # no write may still be landing when the blocks go back
        self.core_for(inc.model).block_manager.free(rid)
        log.warning("rejected KV for %s: %s", rid, reason)
        self._nack(inc.peer, rid, reason)

    def _release_grant(self, rid: str) -> None:
        grant = self.grants.pop(rid)
        bm = self.core_for(grant.model).block_manager
        if not grant.ipc:
            bm.free(rid)
            return
        # the asker may still be copying into these blocks through IPC: park them under a private
        # owner key (the request id may be granted again at once) and free them one TTL later
        self._quarantined += 1
        key = f"ipc-quarantine\x00{self._quarantined}"
        bm.req_blocks[key] = bm.req_blocks.pop(rid, [])
        bm.req_hashes.pop(rid, None)
        self.quarantine.append((time.monotonic() + self.grant_ttl_s, grant.model, key))

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, g in self.grants.items() if g.expires < now]:
            log.warning("grant for %s expired without KV; freeing its blocks", rid)
            self._release_grant(rid)
        for rid in [r for r, inc in self.incoming.items() if inc.deadline < now]:
            self._abort_incoming(rid, f"KV layers stalled: not all arrived within {self.grant_ttl_s}s")
        while self.quarantine and self.quarantine[0][0] < now:
            _, model, key = self.quarantine.pop(0)
            self.core_for(model).block_manager.free(key)

    @staticmethod
    def _holds(core, request_id: str) -> bool:
        return any(r.request_id == request_id for r in core.scheduler.running)

    def _nack(self, peer: bytes, rid: str, reason: str) -> None:
        self._reply(peer, HandoffAck(request_id=rid, ok=False, reason=reason))

    def _reply(self, peer: bytes, msg) -> None:
        try:
            self.sock.send_multipart([peer, encode(msg)], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("could not reply to a prefill worker (its queue is full)")
