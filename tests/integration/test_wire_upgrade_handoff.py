"""A decode worker of this version answering the asks of a prefill worker of the next one, over real ZMQ
sockets: an ask carrying an unknown field declared ignorable is granted; one carrying an unknown
must-understand field is dropped with a clear line (never granted); a protocol more than one version apart is
refused with the reason. And the grant's MAC'd-frames fields are safe to ignore: an asker that does not know
them sends its frames to the grant's socket with CRCs, which the decode worker takes."""

import dataclasses
import logging

import msgpack
import zmq

from kvrelay.prefill_worker.handoff import State
from kvrelay.shared.wire.codec import IGNORABLE_KEY, decode, encode
from kvrelay.shared.wire.handoff import HandoffGrant, HandoffRequest
from kvrelay.shared.wire.version import PROTOCOL_VERSION
from tests.integration.handoff_harness import BLOCK, MODEL, hand_off_tiny, wait_for
from tests.integration.test_handoff import _dealer


def _newer_ask(rid: str, ignorable: dict | None = None, **fields) -> bytes:
    raw = {**msgpack.unpackb(encode(HandoffRequest(rid, MODEL, num_tokens=3 * BLOCK, block_size=BLOCK, ask=1))),
           **fields, **(ignorable or {})}
    raw[IGNORABLE_KEY] = [*raw.get(IGNORABLE_KEY, []), *(ignorable or {})]
    return msgpack.packb(raw, use_bin_type=True)


def _answer(sock: zmq.Socket, data: bytes) -> HandoffGrant:
    sock.send(data)
    return decode(sock.recv(), HandoffGrant)


def test_an_ask_with_an_unknown_ignorable_field_is_granted(decode_side):
    side = decode_side()
    sock = _dealer(side.addr)
    grant = _answer(sock, _newer_ask("r", ignorable={"urgency": 3}, protocol=PROTOCOL_VERSION + 1))
    assert grant.accepted and grant.request_id == "r" and grant.ask == 1, grant.reason
    assert grant.protocol == PROTOCOL_VERSION and side.blocks("r") == grant.block_ids
    sock.close()


def test_an_ask_with_an_unknown_must_understand_field_is_never_granted(decode_side, caplog):
    side = decode_side()
    sock = _dealer(side.addr)
    with caplog.at_level(logging.WARNING):
        sock.send(_newer_ask("strict", kv_zero_points="digest"))  # KV this worker would misread
        grant = _answer(sock, _newer_ask("plain"))  # the next ask is answered; the first never is
    assert grant.accepted and grant.request_id == "plain"
    assert not side.blocks("strict") and "strict" not in side.receiver.grants
    assert any("unknown field(s) kv_zero_points that must be understood" in r.getMessage() for r in caplog.records)
    sock.close()


def test_an_ask_more_than_one_version_apart_is_refused_with_the_reason(decode_side):
    side = decode_side()
    sock = _dealer(side.addr)
    grant = _answer(sock, _newer_ask("far", protocol=PROTOCOL_VERSION + 2))
    assert not grant.accepted and not grant.busy and grant.ask == 1
    assert f"speaks wire protocol {PROTOCOL_VERSION + 2}" in grant.reason and "more than 1 version apart" in grant.reason
    assert not side.blocks("far")
    sock.close()


def test_an_asker_that_ignores_the_frames_fields_falls_back_to_crc_frames(prefill, decode_side):
    """The premise of HandoffGrant.frames_addr / frames_key being ignorable, checked: a prefill worker that does
    not know them (both dropped from the grant it reads) still hands off, bit-exact, over the grant's socket."""
    rt, make = prefill
    side = decode_side(bulk=True)
    manager = make(side.addr)
    on_answer, keyed = manager._on_answer, []

    def as_older_asker(peer, msg):
        if isinstance(msg, HandoffGrant) and msg.frames_key:
            keyed.append(msg.request_id)
            msg = dataclasses.replace(msg, frames_addr="", frames_key=b"")
        on_answer(peer, msg)

    manager._on_answer = as_older_asker
    t, src = hand_off_tiny(manager, rt, "older", 30 * BLOCK)
    assert t.state is State.DONE and t.transport == "layers" and keyed == ["older"], t.reason
    wait_for(lambda: "older" in side.admitted, "admission")
    assert side.receiver.refused_bulk == 0
    assert (side.rt.core.kv.kv_cache[:, :, side.blocks("older")] == rt.core.kv.kv_cache[:, :, src]).all()
