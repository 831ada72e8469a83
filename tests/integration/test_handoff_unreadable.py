"""A prefill worker of this version reading the grants of a decode worker of the next one, over real ZMQ sockets:
a grant carrying an unknown must-understand field is not waited on until the ask times out: the transfer asks
another decode worker at once and gives the grant back, freeing its seat. The sides are handoff_harness.py's."""

import msgpack
import zmq

from kvrelay.prefill_worker.handoff import State
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.handoff import HandoffGrant, HandoffGrants
from tests.integration.handoff_harness import BLOCK, DecodeSide, hand_off_tiny, wait_for


def _as_newer(side: DecodeSide, **fields) -> list[str]:
    """From now on ``side``'s grants carry ``fields`` (unknown ones must be understood); returns the request ids
    granted so (each accepted grant's)."""
    sock, granted = side.receiver.socket, []

    def reply(peer: bytes, msg) -> bool:
        if not isinstance(msg, HandoffGrant | HandoffGrants):
            return type(sock).reply(sock, peer, msg)
        raw = msgpack.unpackb(encode(msg))
        for grant in raw["grants"] if isinstance(msg, HandoffGrants) else [raw]:
            grant.update(fields)
            if grant["accepted"]:
                granted.append(grant["request_id"])
        sock.sock.send_multipart([peer, msgpack.packb(raw, use_bin_type=True)], zmq.NOBLOCK)
        return True

    sock.reply = reply
    return granted


def test_a_grant_that_must_be_understood_is_retried_elsewhere_and_its_seat_freed(prefill, decode_side):
    rt, make = prefill
    newer, older = decode_side(ttl_s=600.0), decode_side()  # the newer one's grant would outlive the test
    kv, total = newer.rt.core.kv, newer.rt.core.kv.num_free_blocks
    granted = _as_newer(newer, kv_zero_points="digest")
    manager = make(newer.addr, timeout_s=600.0, also=(older.addr,))  # its ask would outlive the test too
    t, src = hand_off_tiny(manager, rt, "r", 3 * BLOCK)
    assert t.state is State.DONE and t.target == older.addr and granted == ["r"], t.reason
    wait_for(lambda: not newer.receiver.grants and kv.num_free_blocks == total, "the newer worker's seat freed")
    wait_for(lambda: "r" in older.admitted, "admission")
