"""The prefill role's side of the KV handoff: which decode worker gets a finished prefill's KV. The
transfer itself (grants, streaming during the last chunk, retries, cancels, the ack that lets the
worker XACK the job) is shared/handoff/sender.py's.

A decode worker is chosen among the live ones registered in Redis that serve the model, most free KV
blocks first, then the lightest batch: that spreads load and avoids a grant refusal. The one that last took a
prompt sharing this one's prefix (an n > 1 sibling, the next turn of a chat, a shared system prompt) goes first
while it has the free blocks the prompt needs and its batch is within ``SLACK`` requests of the least loaded
one: it reuses the prompt blocks it holds and is sent only the rest (decode_worker/receiver.py), which no other
can; where each prefix went is remembered by its first MAX_PREFIX_BLOCKS blocks (shared/wire/prefix_affinity.py).
One refused or silent is skipped for the next (up to MAX_ATTEMPTS, then all of them again, after a wait that
doubles each round up to 2 s, while the handoff timeout allows: a full decode batch is backpressure, not failure).

A decode worker that leaves the registry for good (its rank was killed and took it down, or it stopped)
while it holds a transfer owes no answer: the transfer goes to another one at once when only asked or
granted, and when its KV went out it fails as ``target_lost`` (nothing admitted the request), so the
worker runs the job again instead of failing it after the handoff timeout. Gone means absent for longer
than a registration takes to come back after Redis lost it (GONE_AFTER_S).

A decode worker whose heartbeat says its engine loop has been in one step past ``--stalled-step-timeout-s``
(shared/wire/step_stall.py) is not asked (logged once when its stall begins and once when it steps again, never
per request), as the gateway routes it no job: it would read the ask only once it steps again, and the transfer
would wait out the handoff timeout on it before asking another. With only stalled ones serving the model none
is asked either: that is the "no decode worker" case, handled as when the only one is being replaced, since a stall may end (a long step) as a restart does. The prefill keeps its KV and looks
again each round (0.2 s, doubling up to 2 s), so a worker that steps again, or a new one, is asked within a
round of its heartbeat saying so; at the handoff timeout, when an ask to a stalled one would have ended too,
the transfer fails with a reason naming the stalled workers. Asking a stalled one instead would spend that
wait blind to any other decode worker that comes meanwhile; failing at once would throw away a prefill that a
stall a few seconds shorter would have let through.
"""

import logging
import time

import redis
import zmq

from kvrelay.shared.handoff.base import Transport
from kvrelay.shared.handoff.outbound import offered_hashes
from kvrelay.shared.handoff.sender import HandoffSender
from kvrelay.shared.handoff.states import Event, State
from kvrelay.shared.handoff.transfer import FirstToken, Transfer
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.prefix_affinity import MAX_PREFIX_BLOCKS, PrefixAffinity
from kvrelay.shared.wire.protocol import Job, WorkerInfo
from kvrelay.shared.wire.redis_health import RedisHealth
from kvrelay.shared.wire.step_stall import stalled, why_stalled
from kvrelay.shared.wire.zmq_auth import CurveKeys
from kvrelay.shared.worker.directory import live_workers

__all__ = ["FirstToken", "HandoffManager", "State", "Transfer"]

log = logging.getLogger(__name__)

WORKER_CACHE_S = 0.5
SLACK = 8  # requests: how much busier than the least-loaded candidate the remembered worker may be
AFFINITY_CAPACITY = 100_000  # (model, block hash) entries
GONE_AFTER_S = 2 * keys.HEARTBEAT_INTERVAL_S  # a live worker re-registers within a heartbeat of Redis losing it
# the states in which a decode worker holds something of a transfer (its ask, a grant, KV) and owes an answer
HELD_BY_TARGET = (State.GRANT_WAIT, State.GRANTED, State.STREAMING, State.SENDING, State.ACK_WAIT)


class HandoffManager(HandoffSender):
    def __init__(self, ctx: zmq.Context, runtime, timeout_s: float, workers=None, core_for=None,
                 transports: list[Transport] | None = None, *, curve: CurveKeys | None,
                 stalled_step_timeout_s: float = 0.0):
        """``workers()`` lists the candidate decode workers; by default the live ones registered in Redis.
        ``core_for(model)`` is the engine holding that model instance's KV (default: ``runtime.core``).
        ``stalled_step_timeout_s``: a decode worker in one step for longer is not asked (0: any is)."""
        super().__init__(ctx, runtime.config.worker_id, timeout_s, core_for or (lambda model: runtime.core),
                         self._pick_decode_worker, transports, curve=curve)
        self._list_workers = workers or (lambda: live_workers(runtime.redis))
        self.stalled_step_timeout_s = stalled_step_timeout_s
        # test and bench endpoints stand in for a runtime with no Redis: they get a health of their own
        self._health = getattr(runtime, "health", None) or RedisHealth(log)
        self._workers: list[WorkerInfo] = []
        self._workers_at = 0.0
        self._missing: dict[str, float] = {}  # decode worker address -> since when it is not registered
        self._stalled: set[str] = set()  # decode workers skipped as stalled, as of the last read
        # where each prompt prefix's KV went: the next one sharing it goes there
        self.affinity = PrefixAffinity(AFFINITY_CAPACITY)

    def start_early(self, job: Job, entry_id: bytes) -> Transfer:
        """Ask for a grant before the prompt is prefilled, so its KV can stream during the last chunk."""
        return self.start(job, entry_id)

    def prefilled(self, job: Job, entry_id: bytes, first: FirstToken) -> None:
        """The prompt's prefill finished: finish its early transfer, or start one."""
        if not self.complete(job.request_id, first):
            self.start(job, entry_id, first)

    def waiting_for_seat(self, model: str, over_quota: bool = False) -> int:
        """Prefilled transfers of ``model`` waiting now for a decode seat (``over_quota``: for their tenant's KV
        quota there instead) (read by the metrics thread)."""
        return sum(1 for t in list(self.transfers.values())
                   if t.job.model == model and t.seat_wait_from and t.waits_for_quota == over_quota)

    def poll(self, timeout_ms: int = 0) -> list[Transfer]:
        targets = set()
        for t in list(self.transfers.values()):
            if t.target and t.state in HELD_BY_TARGET:
                targets.add(t.target)
                if self._gone(t.target):
                    self._on_target_gone(t)
        self._missing = {addr: since for addr, since in self._missing.items() if addr in targets}
        return super().poll(timeout_ms)  # failed ones among the ended

    def _gone(self, addr: str) -> bool:
        if self._health.down_since is not None:
            return False  # Redis is down: it cannot tell, and the loop must not wait on it every step
        self._refresh()
        now = time.monotonic()
        if any(w.zmq_addr == addr for w in self._workers):
            self._missing.pop(addr, None)
            return False
        return now - self._missing.setdefault(addr, now) > GONE_AFTER_S

    def _on_target_gone(self, t: Transfer) -> None:
        reason = f"decode worker {t.target} left"
        if t.state is State.GRANT_WAIT:
            self._retry(t, reason)
        elif t.state is State.GRANTED:
            t.grant = None
            t.to(Event.PARK)  # asks again once the prompt is computed
        else:
            log.warning("handoff of %s: %s before admitting it", t.job.request_id, reason)
            t.target_lost = True
            self._fail(t, reason)

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._workers_at > WORKER_CACHE_S:
            self._workers_at = now
            try:
                self._workers = self._list_workers()
                self.retain_peers({w.zmq_addr for w in self._workers})
                self._note_stalls()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                # Redis unreachable: the last list still names who was alive, and a dead one refuses
                # or stays silent like any other; the prefill step goes on.
                self._health.failed(exc)

    def _note_stalls(self) -> None:
        """Logged once per stall, at the read that shows it begin and at the one that shows the worker step
        again; never per request."""
        decode = [w for w in self._workers if w.role == "decode"]
        ages = {w.worker_id: w.step_age_s for w in decode if stalled(w, self.stalled_step_timeout_s)}
        for worker_id in sorted(ages.keys() - self._stalled):
            log.warning("decode worker %r is stalled (%s): no KV is handed to it until it steps again", worker_id,
                        why_stalled(ages[worker_id], self.stalled_step_timeout_s))
        live = {w.worker_id for w in decode}
        for worker_id in sorted((self._stalled - ages.keys()) & live):  # one that left is not asked either way
            log.info("decode worker %r steps again: KV is handed to it again", worker_id)
        self._stalled = set(ages)

    def _pick_decode_worker(self, t: Transfer) -> WorkerInfo | None:
        self._refresh()
        model = t.job.model
        live = [w for w in self._serving(model)
                if w.worker_id not in t.tried and not stalled(w, self.stalled_step_timeout_s)]
        if not live:
            return None
        live.sort(key=lambda w: (-_free_kv(w, model), _load(w, model)))
        if t.block_hashes is None:  # worked out once, for every ask of the transfer (outbound.request_for)
            t.block_hashes = offered_hashes(t, self.core_for(model).kv)
        chosen, prefix = live[0], t.block_hashes[:MAX_PREFIX_BLOCKS]
        known = self.affinity.lookup(model, prefix, {w.worker_id for w in live})
        if known is not None:
            w = next(w for w in live if w.worker_id == known)
            need = -(-len(t.job.prompt_token_ids) // self.core_for(model).kv.block_size)
            least = min(_load(c, model) for c in live)
            if _free_kv(w, model) >= need and _load(w, model) - least <= SLACK:
                chosen = w
        self.affinity.record(model, prefix, chosen.worker_id)
        return chosen

    def skipped(self, model: str) -> str:
        """The stalled decode workers of ``model`` (as of the last read), and why: for a failed transfer's reason."""
        why = [f"{w.worker_id} ({why_stalled(w.step_age_s, self.stalled_step_timeout_s)})"
               for w in self._serving(model) if stalled(w, self.stalled_step_timeout_s)]
        return f"; stalled: {'; '.join(why)}" if why else ""

    def _serving(self, model: str) -> list[WorkerInfo]:
        return [w for w in self._workers if w.role == "decode" and model in w.models]


def _free_kv(w: WorkerInfo, model: str) -> int:
    """Blocks the worker could give ``model`` now (its free ones plus what its shared pool could lend)."""
    inst = next((i for i in w.instances if i.instance == model), None)
    return w.free_blocks if inst is None else inst.kv_free_blocks


def _load(w: WorkerInfo, model: str) -> int:
    inst = next((i for i in w.instances if i.instance == model), None)
    return w.running + w.waiting if inst is None else inst.running + inst.waiting
