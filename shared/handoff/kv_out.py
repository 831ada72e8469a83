"""A granted transfer's KV leaving the prefill side (the state machine around it is sender.py's): the grant's
``KVSender`` opened on the first transport that can serve it (outbound.py), its KV pumped out without blocking
the worker's loop, or streamed layer by layer while the forward computes the prompt's last chunk
(``LayerStream``), and the header, which carries the first token, after it. Our blocks are released once nothing
reads them any more (copied / staged), not at the ack."""

import time
from abc import abstractmethod

from kvrelay.shared.handoff.layer_stream import LayerStream
from kvrelay.shared.handoff.outbound import header_for, sender_for, source_blocks
from kvrelay.shared.handoff.sender_io import SenderIO
from kvrelay.shared.handoff.states import Event, State
from kvrelay.shared.handoff.transfer import Transfer
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.handoff import HandoffGrant


class KVOut(SenderIO):
    @abstractmethod
    def _fail(self, t: Transfer, reason: str) -> None:
        """End ``t`` as FAILED, giving back what its decode worker holds for it."""

    @abstractmethod
    def _cancel_grant(self, t: Transfer, reason: str) -> None:
        """Give back ``t``'s grant on its decode worker."""

    def stream_for(self, instance: str) -> LayerStream:
        return LayerStream(self._begin_stream, self._pump, instance)

    def _on_grant(self, t: Transfer, grant: HandoffGrant) -> None:
        t.grant = grant
        src_blocks = source_blocks(t, self.core_for(t.job.model).kv.block_ids(t.job.request_id))
        if isinstance(src_blocks, str):
            self._fail(t, src_blocks)
            return
        t.granted = time.perf_counter()
        t.seat_found()
        if not self._open_sender(t, src_blocks, deferred=False):
            return
        t.header = header_for(t, self.core_for(t.job.model).kv)
        t.deadline = time.monotonic() + self.timeout_s
        t.to(Event.SEND)
        self._pump(t)

    def _begin_stream(self, request_id: str, instance: str, blocks: list[int]) -> Transfer | None:
        """The forward about to run computes the last chunk of ``request_id``'s prompt: if it holds a
        fresh grant, start streaming it and return it (its sender moves layers as they are written)."""
        t = self.transfers.get(request_id)
        if t is None or t.state is not State.GRANTED or t.job.model != instance or not self._fresh(t):
            return None
        kv = self.core_for(instance).kv
        if kv.sharded or kv.sends_parts_to(t.grant.targets):  # parts (or rank 0's gather) go between steps
            return None  # (sharded.py); complete() sends them once the prompt's last chunk ran
        src = source_blocks(t, blocks)
        if isinstance(src, str):
            return None  # complete() sends it the plain way, which reports the mismatch
        if not self._open_sender(t, src, deferred=True):
            return None
        t.granted, t.deadline, t.streamed = time.perf_counter(), time.monotonic() + self.timeout_s, True
        t.to(Event.STREAM)
        return t

    def _open_sender(self, t: Transfer, src_blocks: list[int], deferred: bool) -> bool:
        sender = sender_for(t, self.core_for(t.job.model).kv, self.transports, src_blocks, self.worker_id,
                           self.timeout_s, deferred, self.peers.waker.wake)
        if sender is None:
            self._fail(t, "no transport can serve the grant")
            return False
        t.sender, t.transport, t.nbytes = sender, sender.transport, sender.nbytes
        return True

    def _pump(self, t: Transfer) -> None:
        """Move a SENDING (or STREAMING) transfer as far as it goes without blocking; the header, which
        carries the first token, follows the KV (never before it: it must not promise KV not there)."""
        to = t.sender.to  # its grant's bulk sockets, or the grant's own

        def send(parts: list, stream: int = 0) -> bool:
            return self.peers.send(to[stream] if to else t.target, parts, bulk=bool(to))

        sender = t.sender
        out = sender.pump(t.job.request_id, send)
        if out and t.state is State.SENDING and self.peers.send(t.target, [encode(t.header)]):
            t.sent, t.deadline = time.perf_counter(), time.monotonic() + self.timeout_s
            t.to(Event.KV_OUT)
            t.sender = None  # ZMQ keeps the frames it still has to send alive by itself
        # after the header: the decode side waits for it, and freeing a long prompt's blocks takes a while
        if t.holds_source and sender.source_free():
            self._release_source(t)

    def _check_ranks(self, t: Transfer) -> None:
        """A transfer whose parts the ranks send: a rank that died may never send its part. The group's
        error goes up (the worker is down, its job is run again elsewhere, as after any rank's death) once
        the decode side was told to free the blocks it holds for the transfer now, not at its TTL."""
        core = self.core_for(t.job.model)
        if core is None:
            return
        try:
            core.kv.flush_parts()
        except Exception as exc:
            self._cancel_grant(t, f"a rank of the sender failed: {exc}")
            raise

    def _fresh(self, t: Transfer) -> bool:
        """Direct writes, and streamed layers, must land well inside the grant's lifetime (the decode
        side quarantines lapsed direct-write grants for as long again)."""
        return time.monotonic() - t.asked_at < t.grant.ttl_s / 2

    def _release_source(self, t: Transfer, wait: bool = False) -> None:
        """Free our prefill blocks; with ``wait``, first let in-flight copies out of them finish (also
        when the engine, not us, frees them: a streamed prompt that ended at its first token)."""
        if wait and t.sender is not None:
            t.sender.wait_source()
        if not t.holds_source:
            return
        core = self.core_for(t.job.model)
        if core is not None:
            core.kv.release_held(t.job.request_id)
        t.holds_source = False
