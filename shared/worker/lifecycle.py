"""One request in flight on a worker, whatever the role, and the one way it leaves.

Lifecycle of one request on any worker (prefill, decode, unified):
  1. The role takes it (a Job from the stream, or a KV handoff's header), builds its engine request
     (``engine_request``: the model's extra EOS ids become stop ids) and ``track``s an ``InFlight``.
  2. Each step, before the engine runs, ``sweep`` ends what must not run again: ids the gateway aborted
     (no answer: its client is gone), requests past their deadline (an "abort" event), and the requests
     of a gateway that stopped reading its events, closed its event connection (its process ended:
     link_watch.py) or whose liveness key lapsed (no answer: nobody reads it), so their KV blocks are
     free within that step. An aborted id it holds nothing of, and a gateway that is gone, are
     remembered: the role drops such a request where it enters (``unwanted``), before it costs a step,
     and ``on_gateway_gone`` lets it drop what else it holds of that gateway (a prefill worker's
     handoffs).
  3. The role sends its tokens (``send``: the next ``output_index`` is counted here) and ``finish``es it
     when the engine does.
  4. At the end of a drain ``abandon`` takes every request out of its engine and hands the records to the
     role, which knows whether a peer may run them again.
Whatever ends a request, ``release`` (the role's) gives back what the role holds for it besides its
engine state: a prefill or unified worker ACKs its stream entry.
"""

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import redis

from kvrelay.shared.engine.request import Request
from kvrelay.shared.wire.protocol import Job, TokenEvent
from kvrelay.shared.wire.redis_keys import GATEWAY_TTL_S
from kvrelay.shared.worker.model_slot import ModelSlot
from kvrelay.shared.worker.recent_ids import RecentIds
from kvrelay.shared.worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)


@dataclass(slots=True)
class InFlight:
    request_id: str
    instance: str
    reply_addr: str  # its gateway's ZMQ PULL address: where its events go, whose liveness is watched
    deadline: float  # unix seconds; 0: none
    arrival: float  # unix seconds the gateway took it: a gateway never seen alive gets GATEWAY_TTL_S from here
    max_tokens: int = 0  # what it may produce in all (a prefill worker's engine stops it after one)
    sent: int = 0  # tokens its gateway has: the next event's output_index
    job: Job | None = None  # a stream role's job
    entry_id: bytes = b""  # ... and its stream entry, ACKed once the request leaves
    fetched_at: float = 0.0  # unix seconds it was read from its stream (0: not from a stream)
    asked_at: float = 0.0  # unix seconds the read that returned it was issued


def engine_request(slot: ModelSlot, job: Job) -> Request:
    """The engine request for a Job (read from a stream, or handed off inside a KVHeader). The model's
    first EOS id is the engine's own; the others become stop ids unless the request ignores EOS. Raises
    ValueError/TypeError for a request this model cannot take."""
    params = job.sampling
    eos = slot.eos_ids
    if not params.ignore_eos:
        params = dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *eos[1:]])
    return slot.core.make_request(job.request_id, job.prompt_token_ids, params, eos[0] if eos else None,
                                  job.priority, job.cache_salt, tenant=job.tenant, arrival=job.arrival)


def _keep(_rec: InFlight) -> None:
    pass


def _nothing(_addr: str) -> None:
    pass


MAX_LOST = 1024  # gateway addresses remembered as lost (one per gateway process that ended)


class Lifecycle:
    """The requests in flight on one worker, across the models it hosts."""

    def __init__(self, runtime: WorkerRuntime, worker_id: str = "", release: Callable[[InFlight], None] = _keep):
        """``worker_id`` goes on the events: "" for a stream role, whose jobs a peer reclaims if it dies,
        so the gateway must not fail them on its heartbeat."""
        self.runtime = runtime
        self.worker_id = worker_id
        self._release = release
        self.requests: dict[str, InFlight] = {}
        self._gateways: Counter[str] = Counter()  # reply address -> requests of it here
        self.aborted = RecentIds()  # aborts that came before their request did
        self.gone_gateways = RecentIds()  # reply addresses whose liveness key lapsed
        # reply address -> the liveness value (host-pid) of the gateway process found ended there
        self.lost_gateways: dict[str, str | None] = {}
        self.on_gateway_gone: Callable[[str], None] = _nothing  # the role drops what else it holds of it

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def __len__(self) -> int:
        return len(self.requests)

    def get(self, request_id: str) -> InFlight | None:
        return self.requests.get(request_id)

    def holds(self, instance: str) -> bool:
        return any(r.instance == instance for r in self.requests.values())

    def count(self, instance: str) -> int:
        return sum(r.instance == instance for r in self.requests.values())

    def track(self, rec: InFlight) -> None:
        self.requests[rec.request_id] = rec
        self._gateways[rec.reply_addr] += 1
        if self._gateways[rec.reply_addr] == 1:
            self.runtime.gateways.watch(set(self._gateways))

    def _pop(self, request_id: str) -> InFlight | None:
        rec = self.requests.pop(request_id, None)
        if rec is not None:
            self._gateways[rec.reply_addr] -= 1
            if self._gateways[rec.reply_addr] == 0:
                del self._gateways[rec.reply_addr]
                self.runtime.gateways.watch(set(self._gateways))
        return rec

    # -- events ---------------------------------------------------------------------------------
    def send(self, rec: InFlight, event: TokenEvent) -> None:
        rec.sent += len(event.token_ids)
        self.runtime.events.add(rec.reply_addr, event)

    def end_event(self, rec: InFlight, finish_reason: str, error: str | None = None) -> TokenEvent:
        return TokenEvent(request_id=rec.request_id, finish_reason=finish_reason, error=error,
                          output_index=rec.sent, worker_id=self.worker_id)

    # -- leaving --------------------------------------------------------------------------------
    def finish(self, request_id: str, event: TokenEvent | None = None) -> InFlight | None:
        """The engine is done with it (or never took it): send ``event``, release what the role holds."""
        rec = self._pop(request_id)
        if rec is not None:
            if event is not None:
                self.send(rec, event)
            self._release(rec)
        return rec

    def hand_over(self, request_id: str) -> InFlight | None:
        """Something else of the role holds it now (a prefill worker's handoff): untracked, nothing released."""
        return self._pop(request_id)

    def abort(self, request_id: str, finish_reason: str | None = None, error: str | None = None) -> InFlight | None:
        """Out of its engine now (its blocks are free); an end event only when ``finish_reason`` is given."""
        rec = self._pop(request_id)
        if rec is None:
            return None
        slot = self.runtime.slots.get(rec.instance)
        if slot is not None:
            slot.core.abort([request_id])
        if finish_reason is not None:
            self.send(rec, self.end_event(rec, finish_reason, error))
        self._release(rec)
        return rec

    def sweep(self) -> list[str]:
        """End what must not run another step (see the module's lifecycle). The ids the gateway aborted that
        no record here holds come back (a prefill worker's handoffs may hold them)."""
        elsewhere = [rid for rid in self.runtime.aborts.drain() if self.abort(rid) is None]
        self.aborted.expire()
        self.aborted.add(elsewhere)
        now = time.time()
        for rec in [r for r in self.requests.values() if r.deadline and now > r.deadline]:
            self.abort(rec.request_id, "abort")
        for addr in self.runtime.events.take_stalled():
            self._orphan(addr, "stopped reading its events", lambda rec: True)
        for addr in self.runtime.events.take_lost():
            if not self.runtime.events.reached(addr) and self.runtime.gateways.alive(addr):
                # never connected, but it beats: a live gateway this box has not connected to yet (seen under
                # load), or one that died since its last beat, which its liveness key then tells
                log.warning("gateway %s: no event connection yet, but it beats; its liveness key decides", addr)
                continue
            # its process ended: no grace for young requests, and no waiting out its liveness key's TTL
            self.lost_gateways[addr] = self.runtime.gateways.take_holder(addr)
            while len(self.lost_gateways) > MAX_LOST:
                del self.lost_gateways[next(iter(self.lost_gateways))]
            self._orphan(addr, "closed its event connection", lambda rec: True)
            self.on_gateway_gone(addr)
        for addr in self.runtime.gateways.take_gone():
            # a slow first beat never kills live work: a request gets GATEWAY_TTL_S from its arrival
            self.gone_gateways.add([addr])
            self._orphan(addr, "stopped beating", lambda rec: now > rec.arrival + GATEWAY_TTL_S)
            self.on_gateway_gone(addr)
        return elsewhere

    def unwanted(self, job: Job) -> bool:
        """Nobody waits for this request any more, so it must not enter: its abort came first, or its
        gateway is gone: its process ended (unless another gateway process beats on that address now),
        or it stopped beating (past its grace, and still without a liveness key: a gateway back on the
        same address is alive)."""
        if self.aborted.seen(job.request_id):
            return True
        if job.reply_addr in self.lost_gateways:
            try:
                holder = self.runtime.gateways.holder(job.reply_addr)
            except redis.RedisError:
                return False  # cannot tell: its deadline still ends it
            if holder is None or holder == self.lost_gateways[job.reply_addr]:
                return True
            del self.lost_gateways[job.reply_addr]  # a new gateway process serves that address
        if not self.gone_gateways.seen(job.reply_addr) or time.time() <= job.arrival + GATEWAY_TTL_S:
            return False
        if self.runtime.gateways.alive(job.reply_addr):
            self.gone_gateways.forget(job.reply_addr)
            return False
        return True

    def _orphan(self, addr: str, why: str, due: Callable[[InFlight], bool]) -> None:
        orphans = [r.request_id for r in self.requests.values() if r.reply_addr == addr and due(r)]
        for rid in orphans:
            self.abort(rid)
        if addr not in self._gateways:  # what it has not read yet is for requests that are gone
            self.runtime.events.forget(addr)
        if orphans:
            log.warning("gateway %s %s: aborted its %d request(s)", addr, why, len(orphans))

    def abandon(self) -> list[InFlight]:
        """Drain timeout: every request leaves its engine; the role decides what each record becomes."""
        recs = list(self.requests.values())
        for rec in recs:
            slot = self.runtime.slots.get(rec.instance)
            if slot is not None:
                slot.core.abort([rec.request_id])
        self.requests.clear()
        self._gateways.clear()
        self.runtime.gateways.watch(set())
        return recs
