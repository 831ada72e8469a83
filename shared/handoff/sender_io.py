"""The prefill side's control messages to and from decode workers (the state machine deciding what and when is
sender.py's): each decode worker's pending asks batched into one message, its replies decoded into one answer
a request (or, for a grant that does not decode, what could be read of it: unreadable.py), grants given back
(HandoffCancel). The sockets are peer_sockets.py's."""

import logging
from abc import ABC, abstractmethod

import zmq

from kvrelay.shared.handoff.base import Transport
from kvrelay.shared.handoff.peer_sockets import PeerSockets
from kvrelay.shared.handoff.states import State
from kvrelay.shared.handoff.transfer import Transfer
from kvrelay.shared.handoff.transports import default_transports
from kvrelay.shared.handoff.unreadable import Unread, unread_grants
from kvrelay.shared.wire.codec import decode_any, encode
from kvrelay.shared.wire.handoff import (
    MAX_ASKS,
    HandoffAck,
    HandoffCancel,
    HandoffGrant,
    HandoffGrants,
    HandoffRequest,
    HandoffRequests,
)
from kvrelay.shared.wire.version import PROTOCOL_VERSION
from kvrelay.shared.wire.zmq_auth import CurveKeys

log = logging.getLogger(__name__)


class SenderIO(ABC):
    def __init__(self, ctx: zmq.Context, worker_id: str, timeout_s: float, core_for,
                 transports: list[Transport] | None, curve: CurveKeys | None):
        self.worker_id, self.timeout_s = worker_id, timeout_s
        self.core_for = core_for
        self.transports = default_transports() if transports is None else transports
        self.peers = PeerSockets(ctx, curve)
        self.transfers: dict[str, Transfer] = {}
        self.asks: dict[str, list[tuple[Transfer, HandoffRequest]]] = {}  # per decode worker, until poll()
        self.protocols: dict[str, int] = {}  # the decode workers speaking another protocol version: theirs

    @abstractmethod
    def _on_answer(self, peer: str, msg: HandoffGrant | HandoffAck) -> None:
        """The decode worker at ``peer`` answered about one request: a grant or a refusal, an ack or a nack."""

    @abstractmethod
    def _on_unread_grant(self, peer: str, grant: Unread, reason: str) -> None:
        """The decode worker at ``peer`` answered about ``grant.request_id`` in a grant that did not decode."""

    @abstractmethod
    def _retry(self, t: Transfer, reason: str) -> None:
        """``t``'s ask could not go out: ask another decode worker, or fail."""

    def close(self) -> None:
        self.peers.close()
        for transport in self.transports:
            transport.close()

    def forget_model(self, model: str) -> None:
        for transport in self.transports:
            transport.forget(model)

    def retain_peers(self, live_addrs: set[str]) -> None:
        self.protocols = {addr: v for addr, v in self.protocols.items() if addr in live_addrs}
        for transport in self.transports:
            transport.retain(live_addrs)

    def _send_asks(self) -> None:
        """Each decode worker's pending asks in one message (a step finishes many prompts at once)."""
        while self.asks:
            target, asks = self.asks.popitem()
            # a transfer cancelled or retried elsewhere since it asked is no longer waiting for this grant
            asks = [(t, req) for t, req in asks if self.transfers.get(t.job.request_id) is t
                    and t.state is State.GRANT_WAIT and t.target == target]
            for i in range(0, len(asks), MAX_ASKS):
                batch = asks[i:i + MAX_ASKS]
                msg = batch[0][1] if len(batch) == 1 else HandoffRequests([req for _, req in batch])
                if not self.peers.send(target, [encode(msg)]):
                    for t, _ in batch:
                        self._retry(t, f"decode worker {target} is not reading its requests")

    def _on_reply(self, peer: str, frames: list[bytes]) -> None:
        """A message from the decode worker at ``peer``."""
        try:
            msg = decode_any(frames[0], HandoffGrant, HandoffGrants, HandoffAck)
        except ValueError as exc:
            # a newer decode worker's grant (a field we must have understood): retried elsewhere and given back now,
            # not left to time out here and hold its seat there
            grants = unread_grants(frames[0])
            log.warning("%s handoff reply from %s: %s", "could not read a" if grants else "dropped a malformed", peer, exc)
            for grant in grants:
                self._on_unread_grant(peer, grant, str(exc))
            return
        for reply in msg.grants if isinstance(msg, HandoffGrants) else [msg]:
            if isinstance(reply, HandoffGrant):
                self._note_protocol(peer, reply.protocol)
            self._on_answer(peer, reply)

    def _note_protocol(self, peer: str, protocol: int) -> None:
        """One line per decode worker speaking another protocol version (one too far apart refuses our asks)."""
        if protocol != PROTOCOL_VERSION and self.protocols.get(peer) != protocol:
            self.protocols[peer] = protocol
            log.info("decode worker %s speaks wire protocol %d, this process %d", peer, protocol, PROTOCOL_VERSION)

    def _give_back(self, peer: str, request_id: str, reason: str, epoch: int) -> None:
        """Cancel the grant of ``epoch`` (0: whichever it holds) that the decode worker at ``peer`` made for
        ``request_id``, freeing its seat and blocks there now rather than when the grant expires."""
        self.peers.send(peer, [encode(HandoffCancel(request_id=request_id, reason=reason, epoch=epoch))])
