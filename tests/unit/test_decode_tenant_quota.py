"""--tenant-kv-quota on a decode worker's grants (decode_worker/tenant_quota.py), over a real ZMQ socket pair in
this thread: a real HandoffReceiver over a KV cache without an engine (standalone.py's DetachedCore, whose grants
are all a tenant holds), asked by a DEALER as a prefill worker asks. 16 blocks of 4 tokens, quota 0.25: 4 blocks
a tenant, one 16-token prompt."""

import time

import pytest
import torch
import zmq

from kvrelay.decode_worker import tenant_quota
from kvrelay.decode_worker.receiver import HandoffReceiver
from kvrelay.shared.engine import detached_kv
from kvrelay.shared.handoff.standalone import DetachedCore, serves
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.handoff import HandoffCancel, HandoffGrant, HandoffRequest

MODEL = "tiny"
BLOCK = 4
PROMPT = 4 * BLOCK  # a quota's worth: 4 of the 16 blocks


class Decode:
    def __init__(self, quota: float | None):
        self.ctx = zmq.Context()
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        addr = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
        kv = detached_kv(torch.zeros(1, 2, 16, BLOCK, 1, 4))
        self.core = DetachedCore(kv, max_model_len=64, tenant_kv_quota=quota)
        self.receiver = HandoffReceiver(sock, serves(MODEL, self.core), grant_ttl_s=30.0)
        self.waited: list[tuple[str, str]] = []
        self.held: list[tuple[str, int]] = []
        self.receiver.quota.on_wait = lambda model, tenant: self.waited.append((model, tenant))
        self.receiver.quota.on_grant = lambda model, tenant, blocks: self.held.append((tenant, blocks))
        self.asker = self.ctx.socket(zmq.DEALER)
        self.asker.setsockopt(zmq.LINGER, 0)
        self.asker.connect(addr)

    def ask(self, rid: str, tenant: str, num_tokens: int = PROMPT, early: bool = False) -> HandoffGrant:
        self.asker.send(encode(HandoffRequest(rid, MODEL, num_tokens=num_tokens, block_size=BLOCK, tenant=tenant,
                                              early=early)))
        while not self.asker.poll(10):
            self.receiver.poll(10, admit=lambda header: None)
        return decode(self.asker.recv(), HandoffGrant)

    def cancel(self, rid: str) -> None:
        """The grant's KV is done with (as when its request ends): its blocks go back."""
        self.asker.send(encode(HandoffCancel(rid)))
        while rid in self.receiver.grants:
            self.receiver.poll(10, admit=lambda header: None)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture()
def decode_side():
    sides: list[Decode] = []
    yield lambda quota: sides.append(Decode(quota)) or sides[-1]
    for side in sides:
        side.close()


def _waits(grant: HandoffGrant) -> bool:
    return not grant.accepted and grant.busy and grant.over_quota


def test_a_tenant_over_its_quota_waits_in_order_while_another_is_granted(decode_side):
    d = decode_side(0.25)
    assert d.ask("a1", "A").accepted  # A holds nothing: one request always starts
    a2 = d.ask("a2", "A")
    assert _waits(a2) and "'A' holds 4 KV blocks here and this request needs 4 more, past its --tenant-kv-quota 0.25 of 16" in a2.reason
    assert d.ask("b1", "B").accepted  # no head-of-line blocking across tenants
    assert _waits(d.ask("a3", "A"))
    assert d.receiver.quota.waiting(MODEL) == 2
    assert d.ask("b2", "B").busy  # B is at its own quota now, A's line does not grant it either

    assert _waits(d.ask("a4", "A", early=True))  # asked before its prefill: it parks, taking no place in line
    d.cancel("a1")  # A's blocks free: its oldest waiting ask is granted first
    assert _waits(d.ask("a4", "A", early=True))
    a3 = d.ask("a3", "A")
    assert _waits(a3) and "1 of its requests wait ahead" in a3.reason
    assert d.ask("a2", "A").accepted
    assert _waits(d.ask("a3", "A"))  # A is at its quota again
    d.cancel("a2")
    assert d.ask("a3", "A").accepted
    assert d.receiver.quota.waiting(MODEL) == 1  # b2
    assert d.waited == [(MODEL, "A"), (MODEL, "A"), (MODEL, "B")]  # each request counted once, however often it asked
    assert max(blocks for tenant, blocks in d.held if tenant == "A") == 4  # never more than its quota


def test_a_waiter_that_stops_asking_leaves_the_line(decode_side, monkeypatch):
    """An ask that never comes back (granted elsewhere, aborted) stops holding up its tenant's later asks."""
    monkeypatch.setattr(tenant_quota, "QUOTA_LINE_GRACE_S", 0.05)
    d = decode_side(0.25)
    assert d.ask("a1", "A").accepted
    assert _waits(d.ask("gone", "A"))
    d.cancel("a1")
    assert _waits(d.ask("a2", "A"))  # behind "gone", which may still ask again
    time.sleep(0.1)  # "gone" is unseen past its grace
    assert d.ask("a2", "A").accepted
    assert d.receiver.quota.waiting(MODEL) == 0


def test_without_a_quota_or_a_tenant_nothing_waits(decode_side):
    free = decode_side(None)
    assert all(free.ask(f"a{i}", "A").accepted for i in range(3))
    quota = decode_side(0.25)
    assert all(quota.ask(f"x{i}", "").accepted for i in range(3))  # an older prefill worker names no tenant
    assert free.waited == quota.waited == []
