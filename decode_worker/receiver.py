"""The decode side of the KV handoff: grants (blocks allocated before accepting), KV frames checked
and copied into the granted blocks, and the ack that lets the prefill side XACK the job.

Per request: HandoffRequest -> GRANTED (blocks reserved, expiry armed) -> KVHeader + frames ->
checked -> ADMITTED (in the running batch) + ack; a bad header or frames -> blocks freed + nack;
a grant whose KV never arrives expires and its blocks return to the pool.
"""

import logging
import time
from dataclasses import dataclass

import zmq

from shared.kv_transfer import check_frames, unpack_blocks
from shared.protocol import HandoffAck, HandoffGrant, HandoffRequest, KVHeader, decode_any, encode

log = logging.getLogger(__name__)


@dataclass
class Grant:
    block_ids: list[int]
    num_tokens: int
    expires: float


class HandoffReceiver:
    def __init__(self, sock: zmq.Socket, core, model_name: str, grant_ttl_s: float):
        self.sock = sock
        self.core = core
        self.model_name = model_name
        self.grant_ttl_s = grant_ttl_s
        self.grants: dict[str, Grant] = {}
        self.bytes_received = 0

    def poll(self, timeout_ms: int, admit) -> int:
        """Handle every waiting message; ``admit(header)`` adds an arrived request to the batch.
        Returns the number of messages handled."""
        handled = 0
        if self.sock.poll(timeout_ms, zmq.POLLIN):
            while True:
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                handled += 1
                self._on_message(frames[0].bytes, frames[1].bytes, frames[2:], admit)
        self._expire()
        return handled

    def _on_message(self, peer: bytes, head: bytes, payload: list, admit) -> None:
        try:
            msg = decode_any(head, HandoffRequest, KVHeader)
        except ValueError as exc:
            log.warning("dropped a malformed handoff message: %s", exc)
            return
        if isinstance(msg, HandoffRequest):
            self._reply(peer, self._grant(msg))
            return
        ok, reason = self._accept_kv(msg, payload)
        if ok:
            try:
                admit(msg)
            except ValueError as exc:  # the request itself is invalid here (e.g. a smaller context)
                self._release(msg.request_id)
                ok, reason = False, str(exc)
        self._reply(peer, HandoffAck(request_id=msg.request_id, ok=ok, reason=reason))

    def _grant(self, req: HandoffRequest) -> HandoffGrant:
        def refuse(reason: str) -> HandoffGrant:
            return HandoffGrant(request_id=req.request_id, accepted=False, reason=reason)

        if req.model != self.model_name:
            return refuse(f"model {req.model!r} is not served here")
        if req.block_size != self.core.block_manager.block_size:
            return refuse(f"block size {req.block_size} != {self.core.block_manager.block_size}")
        if self._holds(req.request_id):
            return refuse("duplicate request id")  # a reclaimed job must never stream twice
        if req.request_id in self.grants:
            # KV never came for the earlier grant (its prefill worker died and a peer reclaimed the job):
            # the newer asker wins, and a late KV for the old grant is refused as misaddressed
            self._release(req.request_id)
        sched = self.core.scheduler
        if sched.num_running + len(self.grants) >= self.core.config.scheduler.max_num_seqs:
            return refuse("running batch is full (max_num_seqs)")
        if req.num_tokens >= self.core.max_model_len:
            return refuse(f"{req.num_tokens} tokens exceed max_model_len {self.core.max_model_len}")
        blocks = self.core.block_manager.allocate_for_tokens(req.request_id, req.num_tokens)
        if blocks is None:
            return refuse("no free KV blocks")
        self.grants[req.request_id] = Grant(blocks, req.num_tokens, time.monotonic() + self.grant_ttl_s)
        return HandoffGrant(request_id=req.request_id, accepted=True, block_ids=blocks)

    def _accept_kv(self, header: KVHeader, payload: list) -> tuple[bool, str]:
        grant = self.grants.get(header.request_id)
        if grant is None:
            return False, "no grant for this request (expired or never asked)"
        if header.block_ids != grant.block_ids:
            # a stale sender of a superseded grant: refuse it without touching the live grant
            return False, "KV addressed to blocks that were not granted"
        del self.grants[header.request_id]
        frames = [f.buffer for f in payload]
        try:
            if len(header.prompt_token_ids) != grant.num_tokens:
                raise ValueError("prompt length differs from the granted one")
            check_frames(self.core.runner.kv_cache, header, frames)
        except ValueError as exc:
            self.core.block_manager.free(header.request_id)
            log.warning("rejected KV for %s: %s", header.request_id, exc)
            return False, str(exc)
        unpack_blocks(self.core.runner.kv_cache, grant.block_ids, frames)
        self.bytes_received += header.nbytes
        return True, ""

    def _release(self, request_id: str) -> None:
        self.grants.pop(request_id, None)
        self.core.block_manager.free(request_id)

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, g in self.grants.items() if g.expires < now]:
            log.warning("grant for %s expired without KV; freeing its blocks", rid)
            self._release(rid)

    def _holds(self, request_id: str) -> bool:
        return any(r.request_id == request_id for r in self.core.scheduler.running)

    def _reply(self, peer: bytes, msg) -> None:
        try:
            self.sock.send_multipart([peer, encode(msg)], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("could not reply to a prefill worker (its queue is full)")
