"""A decode worker opens the event connection to a job's gateway when it grants the job's KV
(HandoffRequest.reply_addr, decode_worker/receiver.py ``on_granted``), not when the first event goes: over a real
ZMQ socket pair, a real HandoffReceiver over a KV cache without an engine, asked by a DEALER as a prefill worker
asks. Refused asks and asks that name no gateway dial nothing."""

import pytest

from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.handoff import HandoffGrant, HandoffRequest
from tests.unit.test_decode_tenant_quota import BLOCK, MODEL, PROMPT, Decode

GATEWAY = "tcp://127.0.0.1:5999"


def ask(d: Decode, rid: str, reply_addr: str, num_tokens: int = PROMPT) -> HandoffGrant:
    d.asker.send(encode(HandoffRequest(rid, MODEL, num_tokens=num_tokens, block_size=BLOCK, reply_addr=reply_addr)))
    while not d.asker.poll(10):
        d.receiver.poll(10, admit=lambda header: None)
    return decode(d.asker.recv(), HandoffGrant)


@pytest.fixture()
def side():
    d = Decode(None)
    d.dialed = []
    d.receiver.on_granted = d.dialed.append
    yield d
    d.close()


def test_a_grant_dials_its_gateway(side):
    assert ask(side, "r1", GATEWAY).accepted
    assert side.dialed == [GATEWAY]


def test_a_refusal_and_an_ask_without_a_gateway_dial_nothing(side):
    too_long = ask(side, "r1", GATEWAY, num_tokens=10_000)
    assert not too_long.accepted and "max_model_len" in too_long.reason
    assert ask(side, "r2", "").accepted
    assert side.dialed == []


def test_the_reply_address_survives_the_wire():
    sent = HandoffRequest("r", MODEL, num_tokens=PROMPT, block_size=BLOCK, reply_addr=GATEWAY)
    assert decode(encode(sent), HandoffRequest).reply_addr == GATEWAY
