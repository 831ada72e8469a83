"""What is read of a handoff ask or grant that did not decode (shared/handoff/unreadable.py): request ids, ask
numbers, epochs, checked for type only and bounded; anything else names no request."""

import msgpack

from kvrelay.shared.handoff.unreadable import (
    MAX_REASON_CHARS,
    Unread,
    asks_one_by_one,
    refusal,
    unread_asks,
    unread_grants,
)
from kvrelay.shared.wire.codec import decode_any, encode
from kvrelay.shared.wire.handoff import MAX_ASKS, HandoffGrant, HandoffGrants, HandoffRequest, HandoffRequests
from kvrelay.shared.wire.limits import MAX_ID_LEN


def _packed(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_an_ask_and_a_step_of_asks_name_their_requests_and_numbers():
    assert unread_asks(_packed({"type": HandoffRequest.TAG, "request_id": "r", "ask": 2, "x": 1})) == [Unread("r", 2)]
    asks = [{"request_id": "a"}, {"request_id": "b", "ask": 3}, {"request_id": 7}, "junk", {"request_id": ""}]
    assert unread_asks(_packed({"type": HandoffRequests.TAG, "requests": asks})) == [Unread("a"), Unread("b", 3)]


def test_a_grant_names_its_epoch_and_whether_it_was_accepted():
    raw = {"type": HandoffGrants.TAG, "grants": [{"request_id": "a", "accepted": True, "epoch": 5, "ask": 1},
                                                 {"request_id": "b", "accepted": False}]}
    assert unread_grants(_packed(raw)) == [Unread("a", 1, 5, True), Unread("b", accepted=False)]
    assert unread_asks(_packed(raw)) == []  # a grant is no ask, nor an ask a grant


def test_garbage_names_no_request_and_is_bounded():
    for data in (b"\xc1", _packed(["a", "map"]), _packed({"request_id": "untagged"}),
                 _packed({"type": HandoffRequests.TAG, "requests": "no list"}),
                 _packed({"type": HandoffRequest.TAG, "request_id": "x" * (MAX_ID_LEN + 1)})):
        assert unread_asks(data) == []
    many = [{"request_id": f"r{i}", "ask": -1 if i % 2 else True} for i in range(MAX_ASKS + 5)]
    read = unread_asks(_packed({"type": HandoffRequests.TAG, "requests": many}))
    assert len(read) == MAX_ASKS and {a.ask for a in read} == {0}  # no negative nor boolean ask numbers


def test_the_refusal_echoes_each_ask_and_a_bounded_reason():
    one = decode_any(encode(refusal([Unread("r", 4)], "why")))
    assert one == HandoffGrant("r", accepted=False, reason="why", ask=4)
    step = decode_any(encode(refusal([Unread("a", 1), Unread("b", 2)], "x" * (2 * MAX_REASON_CHARS))))
    assert isinstance(step, HandoffGrants) and [(g.request_id, g.ask) for g in step.grants] == [("a", 1), ("b", 2)]
    assert all(len(g.reason) == MAX_REASON_CHARS and not g.accepted for g in step.grants)


def _step(asks: list, **fields) -> bytes:
    return _packed({"type": HandoffRequests.TAG, "requests": asks, **fields})


def test_a_step_of_asks_is_read_ask_by_ask_refusing_only_the_unreadable_ones():
    good = {k: v for k, v in msgpack.unpackb(encode(HandoffRequest("a", "m", 8, 4, ask=1))).items() if k != "type"}
    newer = {**good, "request_id": "b", "ask": 2, "kv_zero_points": "digest"}
    nameless = {**newer, "request_id": 7}
    read = asks_one_by_one(_step([good, newer, nameless]))
    assert read[0] == HandoffRequest("a", "m", 8, 4, ask=1)
    assert (read[1].request_id, read[1].accepted, read[1].ask) == ("b", False, 2) and len(read) == 2
    assert read[1].reason.startswith("HandoffRequests.requests[1]: unknown field(s) kv_zero_points")


def test_a_step_unreadable_as_a_whole_is_not_read_ask_by_ask():
    good = {k: v for k, v in msgpack.unpackb(encode(HandoffRequest("a", "m", 8, 4))).items() if k != "type"}
    for data in (_step([good], all_or_nothing=True), _step([good] * (MAX_ASKS + 1)), _step([]),
                 _packed({"type": HandoffRequest.TAG, **good, "x": 1}), b"\xc1"):
        assert asks_one_by_one(data) == []
