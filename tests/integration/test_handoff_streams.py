"""Host-staged frames dealt across a decode worker's several plain bulk sockets (--kv-frame-streams), over real ZMQ
sockets: a transfer spread over them lands intact, frames that arrive out of order across them assemble, and a
frame with a bad MAC on any one of them fails the transfer before that frame's bytes land, while the worker goes
on serving; and the sender's bulk connections are spread over the I/O threads."""


import pytest
import torch
import zmq

from kvrelay.prefill_worker.handoff import State
from kvrelay.shared.handoff.frames import StagedKV
from kvrelay.shared.handoff.peer_sockets import PeerSockets
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.handoff import HandoffAck, HandoffGrant
from tests.integration.handoff_harness import BLOCK, hand_off_tiny, read_as_older_asker, wait_for
from tests.integration.test_handoff import _ask, _dealer, _header

STREAMS = 3
NUM_TOKENS = 64 * BLOCK  # 64 blocks: 2 MiB a layer, 2 layers a message, 4 messages over 3 sockets
SRC = list(range(64))


def _frames(kv: torch.Tensor, rid: str, grant: HandoffGrant) -> list[list]:
    staged = StagedKV(kv, SRC, epoch=grant.epoch, key=grant.frames_key)
    return [staged.message(rid, g) for g in range(staged.num_messages)]


def _plain(addr: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    return sock


def _taken(side) -> int:
    return sum(side.receiver.kv_bytes_by_sender.values())


def test_a_transfer_dealt_over_every_bulk_socket_lands_intact(prefill, decode_side):
    rt, make = prefill
    side = decode_side(bulk=STREAMS)
    t, src = hand_off_tiny(make(side.addr), rt, "spread", NUM_TOKENS)
    assert t.state is State.DONE and t.transport == "layers", t.reason
    wait_for(lambda: "spread" in side.admitted, "admission")
    assert len(side.admitted["spread"].job.prompt_token_ids) == NUM_TOKENS
    assert torch.equal(side.rt.core.kv.kv_cache[:, :, side.blocks("spread")], rt.core.kv.kv_cache[:, :, src])
    # one connection a bulk socket, each its own sender id here: the frames came over all three, bytes all counted
    assert len(side.receiver.kv_bytes_by_sender) == STREAMS
    assert _taken(side) == t.nbytes and side.receiver.refused_bulk == 0


def test_frames_arriving_out_of_order_across_the_sockets_assemble(prefill, decode_side):
    rt, _ = prefill
    side = decode_side(bulk=STREAMS)
    kv = rt.core.kv.kv_cache
    control = _dealer(side.addr)
    grant = _ask(control, "r", NUM_TOKENS)
    assert len(grant.frames_addrs) == STREAMS and grant.more_frames_addrs == grant.frames_addrs[1:]
    bulk = [_plain(a) for a in grant.frames_addrs]
    frames = _frames(kv, "r", grant)
    assert len(frames) == 4
    for g in reversed(range(len(frames))):  # last layers first, each on a socket other than the one dealt to it
        before = _taken(side)
        bulk[(g + 1) % STREAMS].send_multipart(frames[g])
        wait_for(lambda before=before: _taken(side) > before, f"frame {g} taken")
    control.send(encode(_header(kv, "r", grant, NUM_TOKENS)))
    ack = decode(control.recv(), HandoffAck)
    assert ack.ok, ack.reason
    assert torch.equal(side.rt.core.kv.kv_cache[:, :, grant.block_ids], kv[:, :, SRC])
    for sock in (control, *bulk):
        sock.close()


def test_an_asker_that_drops_the_other_bulk_sockets_sends_every_frame_to_the_first(prefill, decode_side):
    """The premise of HandoffGrant.more_frames_addrs being ignorable, checked: a prefill worker that does not know it
    (dropped from the grant it reads) still hands off, bit-exact, every frame on the one socket it knows."""
    rt, make = prefill
    side = decode_side(bulk=STREAMS)
    manager = make(side.addr)
    spread = read_as_older_asker(manager, lambda grant: bool(grant.more_frames_addrs), more_frames_addrs=[])
    t, src = hand_off_tiny(manager, rt, "older", NUM_TOKENS)
    assert t.state is State.DONE and t.transport == "layers" and spread == ["older"], t.reason
    wait_for(lambda: "older" in side.admitted, "admission")
    assert torch.equal(side.rt.core.kv.kv_cache[:, :, side.blocks("older")], rt.core.kv.kv_cache[:, :, src])
    assert len(side.receiver.kv_bytes_by_sender) == 1 and _taken(side) == t.nbytes


@pytest.mark.parametrize("stream", range(STREAMS))
def test_a_bad_mac_on_any_bulk_socket_fails_the_transfer_before_its_bytes_land(prefill, decode_side, stream):
    rt, make = prefill
    side = decode_side(bulk=STREAMS)
    kv, total = rt.core.kv.kv_cache, side.rt.core.kv.num_free_blocks
    control = _dealer(side.addr)
    grant = _ask(control, "bad", NUM_TOKENS)
    bulk = [_plain(a) for a in grant.frames_addrs]
    frames = _frames(kv, "bad", grant)
    tampered = bytearray(frames[1][1])
    tampered[100] ^= 0x01
    bulk[stream].send_multipart([frames[1][0], bytes(tampered)])
    ack = decode(control.recv(), HandoffAck)  # nacked as soon as the MAC is checked, before the rest come
    assert not ack.ok and "MAC mismatch at layer 2" in ack.reason, ack.reason
    for g in (0, 2, 3):  # the grant is gone: its other frames, good ones, open nothing
        bulk[g % STREAMS].send_multipart(frames[g])
    control.send(encode(_header(kv, "bad", grant, NUM_TOKENS)))
    assert not decode(control.recv(), HandoffAck).ok
    assert not side.admitted and not side.rt.core.kv.kv_cache[:, :, grant.block_ids].any()
    wait_for(lambda: side.rt.core.kv.num_free_blocks == total, "the failed transfer's blocks")
    t, src = hand_off_tiny(make(side.addr), rt, "good", NUM_TOKENS)  # the worker lives and takes the next
    assert t.state is State.DONE, t.reason
    wait_for(lambda: "good" in side.admitted, "admission")
    assert torch.equal(side.rt.core.kv.kv_cache[:, :, side.blocks("good")], kv[:, :, src])
    for sock in (control, *bulk):
        sock.close()


def test_a_senders_bulk_connections_each_take_an_io_thread_of_their_own():
    """libzmq would give each connection the least busy I/O thread as it opens, but a transfer opens its bulk
    sockets all at once, before any is busy: they would share one and move their bytes on it, one at a time."""
    ctx = zmq.Context(io_threads=1 + STREAMS)
    peers = PeerSockets(ctx, curve=None)
    try:
        for i in range(STREAMS + 1):  # the next one, of a decode worker's next stream, wraps around
            peers.send(f"tcp://127.0.0.1:{40001 + i}", [b"x"], bulk=True)
        peers.send("tcp://127.0.0.1:40000", [b"x"])
        assert [s.getsockopt(zmq.AFFINITY) for s in peers.bulk.values()] == [0b10, 0b100, 0b1000, 0b10]
        assert [s.getsockopt(zmq.AFFINITY) for s in peers.sockets.values()] == [0b1]  # control: thread 0
    finally:
        peers.close()
        ctx.destroy(linger=0)
