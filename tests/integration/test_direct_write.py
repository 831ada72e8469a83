"""Direct KV writes (the CUDA IPC path's logic) on CPU, through the in-process fake of CUDA IPC
(shared/handoff/fake.py): a real HandoffManager and a real HandoffReceiver over real ZMQ sockets, the
decode side offering its cache in the grant, the prefill side mapping it and copying its blocks straight
into the granted ones, with frames as the fallback. tests/gpu/test_kv_ipc.py runs the same between two
processes through the CUDA driver."""

import time
from types import SimpleNamespace

import pytest
import torch
import zmq

from kvrelay.decode_worker.receiver import HandoffReceiver
from kvrelay.prefill_worker.handoff import FirstToken, State
from kvrelay.shared.handoff import grants as grants_module
from kvrelay.shared.handoff.direct import DirectWrite, IpcError
from kvrelay.shared.handoff.fake import InProcess, in_process
from kvrelay.shared.handoff.frames import Frames
from kvrelay.shared.handoff.standalone import endpoint, serves
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.handoff import HandoffGrant, HandoffRequest
from tests.integration.handoff_harness import (
    BLOCK,
    MODEL,
    SHAPE,
    early,
    hand_off_tiny,
    poll_until,
    wait_for,
)


class Unmappable(InProcess):
    """A driver that refuses every mapping (another GPU's handle, a peer that restarted)."""

    def open(self, h, like):
        raise IpcError("the driver refused the handle")


def test_direct_writes_land_bit_exact_and_never_send_a_layer(prefill, decode_side):
    rt, make = prefill
    side = decode_side(transports=[in_process(), Frames()])
    manager = make(side.addr, transports=[in_process(), Frames()])
    total = rt.core.kv.num_free_blocks
    for rid, num_tokens in [("small", 5), ("one-block", BLOCK), ("big", 40 * BLOCK - 3)]:
        t, src = hand_off_tiny(manager, rt, rid, num_tokens)
        assert t.state is State.DONE and t.transport == "ipc", t.reason
        wait_for(lambda rid=rid: rid in side.admitted, "admission")
        assert torch.equal(side.rt.core.kv.kv_cache[:, :, side.blocks(rid)], rt.core.kv.kv_cache[:, :, src])
    assert side.receiver.bytes_received > 0 and rt.core.kv.num_free_blocks == total
    assert len(manager.transports[0].peers[MODEL].mapped) == 1  # mapped once, used three times


def test_layers_are_written_directly_during_the_last_chunk(prefill, decode_side):
    rt, make = prefill
    side = decode_side(transports=[in_process(), Frames()])
    manager = make(side.addr, transports=[in_process(), Frames()])
    kv = rt.core.kv.kv_cache
    final = kv.clone()
    num_tokens = 40 * BLOCK - 3
    src = rt.core.kv.reserve("s", num_tokens)
    kv[:, :, src] = 0
    t = early(manager, "s", num_tokens)
    poll_until(manager, lambda: t.state is State.GRANTED, "the early grant")
    stream = manager.stream_for(MODEL)
    assert stream.begin([("s", src)]) and t.transport == "ipc"
    dst = side.blocks("s")
    for layer in range(SHAPE[0]):
        kv[layer, :, src] = final[layer, :, src]
        stream.layer_done(layer)
        # each layer lands in the decode worker's blocks as soon as the forward wrote it, no later ones
        assert torch.equal(side.rt.core.kv.kv_cache[: layer + 1, :, dst], final[: layer + 1, :, src])
        assert not side.rt.core.kv.kv_cache[layer + 1:, :, dst].any()
    stream.end()
    assert "s" not in side.admitted  # no first token yet, so no header
    assert manager.complete("s", FirstToken(7))
    assert not rt.core.kv.block_ids("s")  # released at once: the copy is done
    ended = poll_until(manager, lambda: "s" not in manager.transfers, "the ack")
    assert [(e.state, e.streamed, e.transport) for e in ended] == [(State.DONE, True, "ipc")]
    wait_for(lambda: "s" in side.admitted, "admission")
    assert side.admitted["s"].first_token_id == 7


def test_a_handle_that_cannot_be_mapped_falls_back_to_frames(prefill, decode_side):
    rt, make = prefill
    side = decode_side(transports=[in_process(), Frames()])
    manager = make(side.addr, transports=[DirectWrite(Unmappable()), Frames()])
    for rid in ("a", "b"):
        t, src = hand_off_tiny(manager, rt, rid, 10 * BLOCK)
        assert t.state is State.DONE and t.transport == "layers", t.reason
        wait_for(lambda rid=rid: rid in side.admitted, "admission")
        assert torch.equal(side.rt.core.kv.kv_cache[:, :, side.blocks(rid)], rt.core.kv.kv_cache[:, :, src])


def test_only_an_asker_in_reach_is_offered_a_handle(prefill, decode_side):
    rt, make = prefill
    side = decode_side(transports=[in_process(), Frames()])
    t, _ = hand_off_tiny(make(side.addr, transports=[Frames()]), rt, "far", 4 * BLOCK)  # asks with no locality
    assert t.state is State.DONE and t.transport == "layers", t.reason
    assert not side.receiver.transports[0].exporters[MODEL].handles


@pytest.mark.parametrize("abandon", ["superseded", "cancelled"])
def test_blocks_offered_for_direct_writes_stay_parked_one_more_ttl(monkeypatch, abandon):
    """An asker that got a handle may still be writing when its grant lapses, is superseded or is
    cancelled, so those blocks are not reused until a second TTL has passed (the asker only writes
    within half of one)."""
    now = [1000.0]
    monkeypatch.setattr(grants_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    side = endpoint(torch.zeros(SHAPE), "d1", MODEL)
    kv, total = side.core.kv, side.core.kv.num_free_blocks
    ctx = zmq.Context()
    router, asker = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    addr = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    asker.connect(addr)
    transport = in_process()
    receiver = HandoffReceiver(router, serves(MODEL, side.core), grant_ttl_s=10.0, transports=[transport, Frames()])
    locality = transport.locality(side.core.kv.kv_cache)

    def ask() -> HandoffGrant:
        asker.send(encode(HandoffRequest("r", MODEL, num_tokens=4 * BLOCK, block_size=BLOCK, device_uuid=locality,
                                         requester="p1")))
        while not asker.poll(0):
            receiver.poll(100, admit=None)
        return decode(asker.recv(), HandoffGrant)

    first = ask()
    assert first.ipc is not None and first.ipc.device_uuid == locality and first.ttl_s == 10.0
    if abandon == "superseded":  # the job was reclaimed by a peer: the newer asker wins
        second = ask()
        assert second.accepted and set(second.block_ids).isdisjoint(first.block_ids)
        assert second.ipc == first.ipc  # one export per asker
        assert kv.num_free_blocks == total - 8
        now[0] += 10.5  # the second grant lapses (parked); the first's parking is over (freed)
        receiver.poll(0, admit=None)
        assert "r" not in receiver.grants and kv.num_free_blocks == total - 4
        assert not set(kv.block_ids("r"))
    else:
        from kvrelay.shared.wire.handoff import HandoffCancel

        asker.send(encode(HandoffCancel("r", reason="ended at its first token")))
        deadline = time.monotonic() + 10
        while "r" in receiver.grants and time.monotonic() < deadline:
            receiver.poll(100, admit=None)
        assert "r" not in receiver.grants and kv.num_free_blocks == total - 4  # parked, not freed
    now[0] += 10.5
    receiver.poll(0, admit=None)
    assert kv.num_free_blocks == total
    ctx.destroy(linger=0)
