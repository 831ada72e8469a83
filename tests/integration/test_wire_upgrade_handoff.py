"""A decode worker of this version answering the asks of a prefill worker of the next one, over real ZMQ
sockets: an ask carrying an unknown field declared ignorable is granted; one carrying an unknown
must-understand field is refused at once with the codec's line (never granted), in a step of asks only that
ask; a protocol more than one version apart is
refused with the reason. And the grant's MAC'd-frames fields are safe to ignore: an asker that does not know
them sends its frames to the grant's socket with CRCs, which the decode worker takes."""


import msgpack
import zmq

from kvrelay.prefill_worker.handoff import State
from kvrelay.shared.wire.codec import IGNORABLE_KEY, decode, encode
from kvrelay.shared.wire.handoff import HandoffGrant, HandoffGrants, HandoffRequest, HandoffRequests
from kvrelay.shared.wire.version import PROTOCOL_VERSION
from tests.integration.handoff_harness import BLOCK, MODEL, hand_off_tiny, read_as_older_asker, wait_for
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


def test_an_ask_with_an_unknown_must_understand_field_is_refused_at_once_naming_it(decode_side):
    """Refused, not dropped: the asker hears why now instead of waiting out its ask timeout."""
    side = decode_side()
    sock = _dealer(side.addr)
    grant = _answer(sock, _newer_ask("strict", kv_zero_points="digest"))  # KV this worker would misread
    assert grant.request_id == "strict" and not grant.accepted and not grant.busy and grant.ask == 1
    assert "unknown field(s) kv_zero_points that must be understood" in grant.reason
    assert not side.blocks("strict") and "strict" not in side.receiver.grants
    assert _answer(sock, _newer_ask("plain")).accepted  # the asker's next ask is served as ever
    sock.close()


def _step(asks: list[dict], **fields) -> bytes:
    return msgpack.packb({"type": HandoffRequests.TAG, "requests": asks, **fields}, use_bin_type=True)


def test_a_step_of_asks_one_of_which_must_be_understood_has_only_that_one_refused(decode_side):
    """One HandoffRequests does not decode for one ask's field: that ask is refused with the codec's line, its
    number echoed, and the others in the step are granted as ever."""
    side = decode_side()
    sock = _dealer(side.addr)
    asks = [{k: v for k, v in msgpack.unpackb(_newer_ask(rid)).items() if k != "type"} for rid in ("a", "b", "c")]
    asks[1].update(ask=2, kv_zero_points="digest")
    sock.send(_step(asks))
    grants = decode(sock.recv(), HandoffGrants).grants
    assert [(g.request_id, g.accepted, g.ask) for g in grants] == [("a", True, 1), ("b", False, 2), ("c", True, 1)]
    assert grants[1].reason.startswith("HandoffRequests.requests[1]: unknown field(s) kv_zero_points that must be "
                                       "understood")
    assert sorted(side.receiver.grants) == ["a", "c"] and side.blocks("a") == grants[0].block_ids
    assert not side.blocks("b")
    sock.send(msgpack.packb(["not", "a", "map"]))  # names no ask: dropped, as ever
    assert _answer(sock, _newer_ask("plain")).request_id == "plain"
    sock.close()


def test_a_step_of_asks_that_must_be_understood_as_a_whole_is_refused_whole(decode_side):
    """A must-understand field of the step itself (not of one ask) bears on every ask in it: none is granted."""
    side = decode_side()
    sock = _dealer(side.addr)
    asks = [{k: v for k, v in msgpack.unpackb(_newer_ask(rid)).items() if k != "type"} for rid in ("a", "b")]
    sock.send(_step(asks, all_or_nothing=True))
    grants = decode(sock.recv(), HandoffGrants).grants
    assert [(g.request_id, g.accepted) for g in grants] == [("a", False), ("b", False)]
    assert all("all_or_nothing" in g.reason for g in grants) and not side.receiver.grants
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
    keyed = read_as_older_asker(manager, lambda grant: bool(grant.frames_key), frames_addr="", frames_key=b"")
    t, src = hand_off_tiny(manager, rt, "older", 30 * BLOCK)
    assert t.state is State.DONE and t.transport == "layers" and keyed == ["older"], t.reason
    wait_for(lambda: "older" in side.admitted, "admission")
    assert side.receiver.refused_bulk == 0
    assert (side.rt.core.kv.kv_cache[:, :, side.blocks("older")] == rt.core.kv.kv_cache[:, :, src]).all()
