"""The prefill side's handoff mechanics: one state machine per transfer (states.py), driven by the
decode side's replies, the transfers' deadlines and, while a prompt's last chunk computes, the
forward's layers (``LayerStream``, shared/handoff/layer_stream.py).

A transfer asks a decode worker for blocks (HandoffRequest) once its prefill finished, or early,
before the prompt's last chunk runs (SGLang-style pre-allocation), so the KV can leave layer by layer
while that chunk computes. The grant names the destination blocks; the first transport that can serve
it (base.py: direct writes on one GPU, else frames) gives the transfer a ``KVSender``; once the sender
reports all the KV out, the header (which carries the first token) follows, and the decode side's ack
ends the transfer. Our blocks are released once nothing reads them any more (copied / staged), not at
the ack. A grant a prompt will not use is cancelled (HandoffCancel), never left to expire. Only the answer
to a transfer's latest ask counts (its number, echoed, and the worker it came from: ``_answers_ask``); a grant
answering an ask given up is cancelled on the worker that made it. Only the worker the KV went to acks or nacks
it: another's answer about the request is ignored. A peer that stops answering or reading fails its transfer at
the deadline instead of stalling the worker's loop.
The asks, replies and cancels go through sender_io.py; a granted transfer's KV leaves through kv_out.py.
"""

import logging
import math
import time
from collections.abc import Callable

import zmq

from kvrelay.shared.handoff.base import Transport
from kvrelay.shared.handoff.grant_hold import GrantHold
from kvrelay.shared.handoff.kv_out import KVOut
from kvrelay.shared.handoff.outbound import header_for, request_for
from kvrelay.shared.handoff.rank_parts import RankParts
from kvrelay.shared.handoff.spin_poll import REPLY_SPIN_S
from kvrelay.shared.handoff.states import Event, State
from kvrelay.shared.handoff.transfer import FirstToken, Transfer
from kvrelay.shared.handoff.unreadable import Unread
from kvrelay.shared.wire.handoff import HandoffAck, HandoffGrant
from kvrelay.shared.wire.protocol import Job, WorkerInfo
from kvrelay.shared.wire.zmq_auth import CurveKeys

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
# A transfer with no decode worker to ask (none registered, or every one refused) looks again after
# NO_WORKER_RETRY_S, each round in a row twice as long up to MAX_NO_WORKER_RETRY_S: a cluster whose decode workers
# all refuse (a version apart too far, a KV layout they cannot take) is not asked five times a second per prompt.
# Refused for lack of room, it keeps to NO_WORKER_RETRY_S.
NO_WORKER_RETRY_S = 0.2
MAX_NO_WORKER_RETRY_S = 2.0


def reask_wait_s(rounds: int) -> float:
    """The wait after ``rounds`` rounds in a row (0: the first) in which no decode worker took the transfer."""
    return min(NO_WORKER_RETRY_S * 2 ** min(rounds, 16), MAX_NO_WORKER_RETRY_S)


Pick = Callable[[Transfer], WorkerInfo | None]  # a transfer (its job, the worker ids it tried) -> whom to ask


class HandoffSender(KVOut):
    def __init__(self, ctx: zmq.Context, worker_id: str, timeout_s: float, core_for, pick: Pick,
                 transports: list[Transport] | None = None, *, curve: CurveKeys | None):
        """``core_for(model)``: the EngineCore holding that model instance's KV (its ``kv``: the connector
        seam, shared/engine/kv_connector.py); ``pick``: whom to ask next;
        ``curve``: the deployment's keys, without which decode workers do not let us in."""
        super().__init__(ctx, worker_id, timeout_s, core_for, transports, curve)
        self.pick = pick
        self.hold = GrantHold()  # how long our grants must live, from how often we read replies

    def skipped(self, model: str) -> str:
        """Said after "no decode worker" in a failed transfer's reason: those of ``model`` ``pick`` passes over
        (none here), and why."""
        return ""

    @property
    def busy(self) -> bool:
        return bool(self.transfers)

    def has_model(self, model: str) -> bool:
        return any(t.job.model == model for t in self.transfers.values())

    def start(self, job: Job, entry_id: bytes, first: FirstToken | None = None) -> Transfer:
        """Hand off a prompt whose prefill finished (its blocks held by the engine), or with no
        ``first`` ask early, before it is prefilled, so its KV can stream during the last chunk."""
        t = self.transfers[job.request_id] = Transfer(job=job, entry_id=entry_id, first=first,
                                                      holds_source=first is not None)
        self._send_request(t)
        return t

    def complete(self, request_id: str, first: FirstToken) -> bool:
        """The prefill of an early transfer's prompt finished: send the rest. False if there is none."""
        t = self.transfers.get(request_id)
        if t is None or t.computed or t.state is State.FAILED:
            return False
        t.first, t.holds_source = first, True
        t.started = time.perf_counter()  # the handoff's budget and its measured time start now
        if t.state is State.STREAMING:
            t.header = header_for(t, self.core_for(t.job.model).kv)
            t.to(Event.SEND)
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
        if t is None:
            return None
        if t.state not in (State.DONE, State.FAILED):
            self._fail(t, "cancelled by the prefill worker")
        return t

    def poll(self, timeout_ms: int = 0) -> list[Transfer]:
        """Send the asks made since the last call; advance every transfer; return those that reached
        DONE or FAILED."""
        self.hold.polled()
        self._send_asks()
        for peer, frames in self.peers.replies(timeout_ms, REPLY_SPIN_S if self._reply_due() else 0.0):
            self._on_reply(peer, frames)
        now = time.monotonic()
        for t in list(self.transfers.values()):
            if t.transport == RankParts.name and t.state in (State.SENDING, State.ACK_WAIT):
                self._check_ranks(t)
            if t.state in (State.SENDING, State.STREAMING):
                self._pump(t)
            if not t.computed and t.state in (State.GRANT_WAIT, State.GRANTED):
                if t.state is State.GRANTED and not self._fresh(t):  # the prompt is still queued
                    self._cancel_grant(t, "the prompt is still waiting for its prefill")
                    t.to(Event.PARK)
                elif t.state is State.GRANT_WAIT and now > t.deadline:
                    self._cancel_grant(t, "no answer before the prompt was computed")  # in case one comes
                    t.to(Event.PARK)  # no answer: not worth more asks before the prefill
                continue
            if t.state is State.GRANT_WAIT and not t.target and now > t.deadline:
                self._send_request(t)  # waiting for a decode worker to register (see _send_request)
            elif t.state in (State.GRANT_WAIT, State.STREAMING, State.SENDING, State.ACK_WAIT) and now > t.deadline:
                t.waits_for_room = False  # a peer that does not answer is not one with a full batch
                what = "take the KV" if t.state in (State.SENDING, State.STREAMING) else "answer"
                self._retry(t, f"decode worker {t.target} did not {what} within {self.timeout_s}s")
        self._send_asks()
        ended = [t for t in self.transfers.values() if t.state in (State.DONE, State.FAILED)]
        for t in ended:
            t.ended = time.perf_counter()
            del self.transfers[t.job.request_id]
        return ended

    def _reply_due(self) -> bool:
        """Whether an answer to an ask or an ack of a header is on its way (spin_poll.py)."""
        return any(t.state is State.ACK_WAIT or (t.state is State.GRANT_WAIT and t.target)
                   for t in self.transfers.values())

    # -- transitions ----------------------------------------------------------------------------
    def _send_request(self, t: Transfer, after: str = "") -> None:
        target = self.pick(t)
        if target is None and not t.computed:
            t.target = ""
            t.to(Event.PARK)
            return
        if target is None and self._in_budget(t):
            # None registered (Redis just restarted, the only decode worker is being replaced) or every
            # one refused for lack of room: that is backpressure, not failure. Keep the KV and ask them
            # all again later, the last time as the budget ends, so the transfer fails at it, not past it.
            t.tried.clear()
            # a full batch frees a seat whenever one of its requests ends: no backing off from that
            wait = NO_WORKER_RETRY_S if t.waits_for_room else reask_wait_s(t.rounds_refused)
            t.rounds_refused += not t.waits_for_room
            wait = min(wait, self._budget_left(t))
            t.target, t.deadline = "", time.monotonic() + wait
            t.to(Event.ASK)
            return
        if target is None:
            skipped = self.skipped(t.job.model)
            self._fail(t, f"{after}; no other decode worker to try{skipped}" if after
                       else f"no decode worker for this model{skipped}")
            return
        t.target, t.target_id = target.zmq_addr, target.worker_id
        t.to(Event.ASK)
        t.tried.add(target.worker_id)
        t.ask += 1
        t.asked_at = time.monotonic()
        t.deadline = t.asked_at + self.timeout_s
        req = request_for(t, self.core_for(t.job.model).kv, self.transports, self.worker_id, self.hold.hold_s)
        self.asks.setdefault(t.target, []).append((t, req))  # sent by poll(), with the step's other asks

    def _on_answer(self, peer: str, msg: HandoffGrant | HandoffAck) -> None:
        t = self.transfers.get(msg.request_id)
        if isinstance(msg, HandoffGrant) and (t is None or t.state is State.PARKED or not self._answers_ask(t, peer, msg)):
            # an answer to an ask given up: the transfer ended, stopped waiting, or asked again since (there or
            # elsewhere). The decode side keeps the grants of live askers: a grant in it must be given back, or it
            # holds a seat there
            if msg.accepted:
                self._give_back(peer, msg.request_id, "granted for an ask given up", msg.epoch)
            return
        if t is None:
            return  # a late ack for a transfer that already timed out or was cancelled
        if isinstance(msg, HandoffGrant) and t.state is State.GRANT_WAIT:
            if msg.accepted:
                t.rounds_refused = 0
            if msg.accepted and not t.computed:
                t.grant = msg
                t.to(Event.GRANTED)
            elif msg.accepted:
                self._on_grant(t, msg)
            elif not t.computed:
                t.to(Event.PARK)  # e.g. its batch is full now; by the time we are done it may not be
            else:
                t.waits_for_room = msg.busy
                if msg.busy:
                    t.wait_for_seat(msg.over_quota)
                self._retry(t, f"decode worker refused: {msg.reason}")
        elif isinstance(msg, HandoffAck) and peer != t.target:
            # only the decode worker holding the KV can say whether it landed
            log.debug("ignored an answer about %s's KV from %s; it went to %s", msg.request_id, peer, t.target)
        # an answer about an earlier grant of the request (a stale header's nack) is not one about this grant
        elif isinstance(msg, HandoffAck) and t.state is State.ACK_WAIT and t.grant and msg.epoch == t.grant.epoch:
            if msg.ok:
                t.to(Event.ACK)
            else:
                t.target_lost = msg.worker_down  # its worker runs the job again (prefill_worker/worker.py)
                self._fail(t, f"decode worker rejected the KV: {msg.reason}")

    def _on_unread_grant(self, peer: str, grant: Unread, reason: str) -> None:
        t = self.transfers.get(grant.request_id)
        answers = t is not None and t.state is State.GRANT_WAIT and self._answers_ask(t, peer, grant)
        # without its epoch, a cancel gives up whichever grant the worker holds: only ours if this answers our ask
        if grant.accepted and (grant.epoch or answers):
            self._give_back(peer, grant.request_id, "a grant this worker cannot read", grant.epoch)
        if answers:
            self._retry(t, f"decode worker's grant could not be read: {reason}")

    @staticmethod
    def _answers_ask(t: Transfer, peer: str, grant: HandoffGrant | Unread) -> bool:
        """Whether ``grant`` (from ``peer``) answers ``t``'s latest ask. One that does not echo the ask's number (0:
        a decode worker older than the numbers) is taken for the answer to the latest ask of the worker it came from."""
        return peer == t.target and grant.ask in (t.ask, 0)

    def _cancel_grant(self, t: Transfer, reason: str) -> None:
        """Give back ``t``'s grant; with none yet, whichever its ask gets."""
        self._give_back(t.target, t.job.request_id, reason, 0 if t.grant is None else t.grant.epoch)
        t.grant = None

    def _retry(self, t: Transfer, reason: str) -> None:
        if t.state is not State.GRANT_WAIT or (len(t.tried) >= MAX_ATTEMPTS and not self._in_budget(t)):
            # once KV went out, the decode side may hold a half transfer: fail (the cancel frees it there)
            log.warning("handoff of %s: %s", t.job.request_id, reason)
            self._fail(t, reason)
            return
        log.debug("handoff of %s: %s; asking again", t.job.request_id, reason)  # under load: a round at most every 0.2 s
        self._send_request(t, after=reason)

    def _in_budget(self, t: Transfer) -> bool:
        return self._budget_left(t) > 0

    def _budget_left(self, t: Transfer) -> float:
        """A transfer may keep looking for a decode worker with room until the handoff timeout; one that
        live decode workers refused only for lack of room waits for a seat until its job's deadline, as a
        request waits in vLLM's queue: a full batch is load, not an error."""
        left = self.timeout_s - (time.perf_counter() - t.started)
        if t.waits_for_room:
            until_deadline = t.job.deadline - time.time() if t.job.deadline else math.inf
            if until_deadline > 0:
                return max(left, until_deadline)
        return left

    def _fail(self, t: Transfer, reason: str) -> None:
        if t.target and t.state not in (State.NEW, State.PARKED, State.DONE, State.FAILED):
            # the decode side keeps what a live asker was granted: give it back now (a no-op there when
            # it refused, or already dropped the transfer)
            self._cancel_grant(t, f"failed on the prefill side: {reason}")
        t.seat_found()
        self._release_source(t, wait=True)
        t.reason, t.sender = reason, None
        t.to(Event.FAIL)
