"""Each rank of a tensor- or pipeline-parallel DECODE group takes its own share of a handed-off prompt's KV (its
stage's layers, its KV heads of them) on a socket of its own, so the KV never passes through rank 0 nor a full
staging copy. Rank 0 keeps the transfer's control (grant, header, ack, cancel, deadlines).

    rank 0 (InletDriver)                          rank r (Inlet: a thread beside the rank's step loop)
    RankInletHello <-- its inlet's address, once (a PUSH to rank 0's PULL in the group's private folder)
    grant: RankKVExpect over the step broadcast --> expected: a ShareAssembler over its blocks
           HandoffGrant.targets: every rank's             KVLayers parts from the sender's ranks, placed by
           (address, layers, heads)                       (layer, head), each layer CRC-checked
    RankKVDone (ok, bytes, or why not)           <-- every (layer, head) of its share is in: done / failed
    cancel, failure, expiry: RankKVDrop          --> dropped (any write still landing is waited for first)

Rank 0 lands the request (admits it, acks) only once its own share and every rank's ``RankKVDone`` are in. A
part that comes before its RankKVExpect (the rank's loop was in a step) is parked, bounded in count and age. A
part is its grant's by requester and epoch (HandoffGrant.epoch, which grows with every grant): one of an earlier
grant of the request (given up, its parts still in flight when the request was granted again) is dropped and
counted (``stale``), never taken for the new one; one of a later grant waits, parked, for its RankKVExpect.
A rank that dies takes the group down (group.py); rank 0's transfer then fails at once and the request is run
again, as for any dead worker. Until every rank has said where it listens, grants carry no targets and the KV
goes through rank 0 as before (shared/handoff/sharded.py).
"""

import logging
import threading
import time
from pathlib import Path
from typing import NamedTuple

import torch
import zmq

from kvrelay.shared.engine.parallel.layout import RankLayout
from kvrelay.shared.engine.parallel.linear import kv_heads
from kvrelay.shared.engine.ranks.group import RankGroup
from kvrelay.shared.engine.ranks.kv_moves import stage_layers, total_kv_heads
from kvrelay.shared.engine.ranks.kv_share import ShareAssembler
from kvrelay.shared.wire import zmq_auth
from kvrelay.shared.wire.codec import decode_any, encode
from kvrelay.shared.wire.handoff import KVLayers, KVTarget
from kvrelay.shared.wire.rank_step import RankInletHello, RankKVDone, RankKVDrop, RankKVExpect
from kvrelay.shared.wire.zmq_auth import CurveKeys

log = logging.getLogger(__name__)

POLL_MS = 20  # the inlet thread's wait for parts; also how soon a finished share is reported
MAX_PARKED = 256  # parts held for a transfer not yet expected (the rank's loop is in a step)
PARK_S = 30.0  # a parked part nobody expects after this long is dropped
MAX_FRAME = 256 << 20  # one KVLayers frame (~4 MB by design; bounded so a peer cannot make us buffer more)


class Expected(NamedTuple):
    """A grant this rank takes its share of: whose, which, and the share's assembler."""

    requester: str
    epoch: int
    share: ShareAssembler


def reports_address(folder: Path) -> str:
    return f"ipc://{folder / 'inlet.sock'}"


def share_of(model, layout: RankLayout) -> KVTarget:
    """The model's layers and KV heads a rank of ``layout`` holds (its address left to fill)."""
    start, end = stage_layers(model)[layout.stage]
    first, count = kv_heads(total_kv_heads(model), layout.tp_rank, layout.tp)
    return KVTarget("", [start, end], [first, count])


class Inlet:
    """A decode rank's socket for its shares and the thread that assembles them into its cache."""

    def __init__(self, rank: int, keys: CurveKeys | None, host: str, folder: Path, origin: tuple[int, int],
                 advertise: str | None = None) -> None:
        self.rank, self.origin = rank, origin
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        zmq_auth.serve(self._sock, keys)
        self.address = f"tcp://{advertise or host}:{self._sock.bind_to_random_port(f'tcp://{host}')}"
        self._reports = self._ctx.socket(zmq.PUSH)
        self._reports.setsockopt(zmq.LINGER, 0)
        self._reports.connect(reports_address(folder))
        self._lock = threading.Lock()  # the thread's work vs. the step loop's expect/drop
        self._expected: dict[str, Expected] = {}  # by request id
        self._parked: list[tuple[float, KVLayers, list]] = []
        self.stale = 0  # parts of an earlier grant (or another requester's) of a request expected here, dropped
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-inlet-{rank}", daemon=True)
        self._thread.start()

    def expect(self, msg: RankKVExpect, kv_cache: torch.Tensor) -> None:
        with self._lock:
            # a newer grant for the same id supersedes the old: its parts go, but not those already here for
            # this grant (its sender may be quicker than this rank's loop, which was in a step)
            rid = msg.request_id
            parked = [p for p in self._parked if p[1].request_id == rid]
            self._parked = [p for p in self._parked if p[1].request_id != rid]
            self._expected[rid] = Expected(msg.requester, msg.epoch,
                                           ShareAssembler(kv_cache, msg.block_ids, self.origin))
            for _, part, frames in parked:
                self._take(part, frames)

    def drop(self, msg: RankKVDrop) -> None:
        """Before this returns no write of the transfer's is still landing: its blocks may be reused."""
        with self._lock:
            held = self._expected.get(msg.request_id)
            if held is not None and held.epoch <= msg.epoch:
                del self._expected[msg.request_id]  # its writes are synchronous, under the lock: none is landing
            self._parked = [p for p in self._parked if p[1].request_id != msg.request_id or p[1].epoch > msg.epoch]

    def _run(self) -> None:
        self._report(RankInletHello(self.rank, self.address))
        while not self._stop.is_set():
            try:
                ready = self._sock.poll(POLL_MS)
                with self._lock:
                    while ready:
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_message(frames)
                    self._advance()
            except zmq.ContextTerminated:
                return
            except Exception:  # noqa: BLE001 - this thread must outlive a bad message; rank 0's TTL fails its transfer
                log.exception("rank %d: KV inlet", self.rank)

    def _on_message(self, frames: list) -> None:
        try:
            msg = decode_any(frames[1].bytes, KVLayers) if len(frames) >= 2 else None
        except ValueError as exc:
            msg = None
            log.warning("dropped a malformed KV part: %s", exc)
        if msg is None or not msg.is_part:
            return
        self._take(msg, [f.buffer for f in frames[2:]])

    def _take(self, msg: KVLayers, frames: list) -> None:
        held = self._expected.get(msg.request_id)
        if held is None or msg.epoch > held.epoch:  # expected later: this rank's loop was in a step
            if len(self._parked) < MAX_PARKED:
                self._parked.append((time.monotonic(), msg, frames))
            return
        if (msg.requester, msg.epoch) != (held.requester, held.epoch):
            self.stale += 1
            log.info("rank %d: dropped a KV part of %s for %s's grant epoch %d; its grant here is %s's epoch %d "
                     "(%d stale so far)", self.rank, msg.request_id, msg.requester, msg.epoch, held.requester,
                     held.epoch, self.stale)
            return
        try:
            held.share.add(msg, frames)
        except Exception as exc:  # noqa: BLE001 - whatever breaks a share fails its transfer, not this thread
            return self._finish(msg.request_id, str(exc))
        if held.share.complete:
            self._finish(msg.request_id, "")

    def _advance(self) -> None:
        now = time.monotonic()
        self._parked = [p for p in self._parked if now - p[0] < PARK_S]

    def _finish(self, rid: str, error: str) -> None:
        held = self._expected.pop(rid)
        if error:
            log.warning("rank %d: KV share of %s failed: %s", self.rank, rid, error)
        self._report(RankKVDone(self.rank, rid, ok=not error, nbytes=held.share.nbytes, reason=error[:1000],
                                epoch=held.epoch))

    def _report(self, msg) -> None:
        try:
            self._reports.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # rank 0 reads reports every pass of its loop: a full queue means it is gone
            log.warning("rank %d: could not report to rank 0", self.rank)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._reports.close(linger=0)
        self._ctx.term()


class InletDriver:
    """Rank 0's end: where its ranks listen, what each was told to expect, and what each reported."""

    def __init__(self, ranks: RankGroup, model) -> None:
        self.ranks, self.world = ranks, ranks.world_size
        tp = ranks.world_size // ranks.pipeline
        self.shares = [share_of(model, RankLayout(r, tp, ranks.pipeline)) for r in range(self.world)]
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(reports_address(ranks.folder))
        self.addresses: dict[int, str] = {}
        # expected transfer -> (its grant's epoch, its ranks' reports)
        self._reports: dict[str, tuple[int, dict[int, RankKVDone]]] = {}
        self.bytes_by_rank: dict[int, int] = {}  # KV bytes each rank took itself (for tests and metrics)

    @property
    def reports(self) -> zmq.Socket:
        """Where the ranks' reports arrive: rank 0's loop may wait on it (``poll`` and ``state`` read it)."""
        return self._sock

    def poll(self) -> None:
        while True:
            try:
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode_any(data, RankInletHello, RankKVDone)
            except ValueError as exc:
                log.warning("dropped a malformed report from a rank: %s", exc)
                continue
            if isinstance(msg, RankInletHello):
                self.addresses[msg.rank] = msg.address
            elif msg.request_id in self._reports and 0 < msg.rank < self.world:
                epoch, reports = self._reports[msg.request_id]
                if msg.epoch != epoch:
                    continue  # on an earlier grant of the request, read after it was granted again
                reports[msg.rank] = msg
                self.bytes_by_rank[msg.rank] = self.bytes_by_rank.get(msg.rank, 0) + msg.nbytes

    def targets(self, rid: str, requester: str, epoch: int, block_ids: list[int]) -> list[KVTarget]:
        """Tell every rank to expect its share of ``rid``'s grant ``epoch``; the grant's targets (rank 0's address
        left empty: the grant's socket). Empty until every rank has said where it listens."""
        self.poll()
        self.drop(rid)
        if len(self.addresses) < self.world - 1:
            return []
        try:
            self.ranks.send(RankKVExpect(rid, requester, list(block_ids), epoch))
        except (RuntimeError, zmq.ZMQError):  # the group is down: the engine's next step raises it
            return []
        self._reports[rid] = (epoch, {})
        return [self.shares[0]] + [KVTarget(self.addresses[r], s.layers, s.heads)
                                   for r, s in enumerate(self.shares) if r > 0]

    def expects(self, rid: str) -> bool:
        return rid in self._reports

    def state(self, rid: str) -> tuple[bool, str, bool]:
        """(every rank's share is in, why one failed or "", whether the group is down)."""
        try:
            self.ranks.check()  # a dead rank's share never comes: fail now, not at the TTL
        except RuntimeError as exc:
            return False, str(exc), True
        self.poll()
        reports = self._reports[rid][1] if rid in self._reports else {}
        failed = next((f"rank {r}: {m.reason}" for r, m in sorted(reports.items()) if not m.ok), "")
        return len(reports) == self.world - 1 and not failed, failed, False

    def forget(self, rid: str) -> None:
        """Its ranks finished (each dropped it on reporting): nothing to tell them."""
        self._reports.pop(rid, None)

    def drop(self, rid: str) -> None:
        expected = self._reports.pop(rid, None)
        if expected is not None:
            try:
                self.ranks.send(RankKVDrop(rid, expected[0]))
            except (RuntimeError, zmq.ZMQError):
                pass  # the group is down: no rank writes anything any more

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
