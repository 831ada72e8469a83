"""A prefill worker of this version reading the grants of a decode worker of the next one, over real ZMQ sockets:
a grant carrying an unknown must-understand field is not waited on until the ask times out: the transfer asks
another decode worker at once and gives the grant back, freeing its seat. A grant of another protocol version
(one apart) is served, with one line per decode worker saying so. The sides are handoff_harness.py's."""

import logging

import msgpack
import zmq

from kvrelay.prefill_worker.handoff import State
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.handoff import HandoffGrant, HandoffGrants
from kvrelay.shared.wire.version import PROTOCOL_VERSION
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


def test_a_grant_one_protocol_version_apart_is_served_and_noted_once(prefill, decode_side, caplog):
    rt, make = prefill
    side = decode_side()
    _as_newer(side, protocol=PROTOCOL_VERSION + 1)
    manager = make(side.addr)
    with caplog.at_level(logging.INFO, logger="kvrelay.shared.handoff.sender_io"):
        for rid in ("a", "b"):
            t, _ = hand_off_tiny(manager, rt, rid, 2 * BLOCK)
            assert t.state is State.DONE, t.reason
    noted = [r.getMessage() for r in caplog.records if "speaks wire protocol" in r.getMessage()]
    assert noted == [f"decode worker {side.addr} speaks wire protocol {PROTOCOL_VERSION + 1}, this process "
                     f"{PROTOCOL_VERSION}"]
