"""The KV handoff over real ZMQ sockets: a real HandoffManager (prefill side) in the test thread, a real
HandoffReceiver (decode side) in another, or a hand-driven socket where a test needs a peer that
misbehaves (corrupts a payload, stalls); the two sides are tests/integration/handoff_harness.py. Frames are the transport
unless a test says otherwise (tests/integration/test_direct_write.py covers direct writes)."""

import subprocess
import sys

import pytest
import torch
import zmq

from kvrelay.prefill_worker.handoff import FirstToken, State
from kvrelay.shared.engine import detached_kv
from kvrelay.shared.handoff.blocks import layout_of
from kvrelay.shared.handoff.frames import StagedKV
from kvrelay.shared.handoff.standalone import synthetic_job
from kvrelay.shared.wire import zmq_auth
from kvrelay.shared.wire.codec import decode, decode_any, encode
from kvrelay.shared.wire.handoff import (
    HandoffAck,
    HandoffGrant,
    HandoffGrants,
    HandoffRequest,
    HandoffRequests,
    KVHeader,
    KVLayers,
)
from tests.integration.handoff_harness import (
    BLOCK,
    MODEL,
    SHAPE,
    early,
    hand_off_tiny,
    poll_until,
    wait_for,
)
from tests.zmq_secret import CURVE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_handoffs_land_bit_exact(prefill, decode_side, dtype):
    """bf16 halves a layer, so the big transfer packs more layers into a message than one layer of the
    whole cache: the receive bound must allow for that (it once did not)."""
    rt, make = prefill
    rt.core.kv = detached_kv(rt.core.kv.kv_cache.to(dtype), scatter_seed=3)
    side = decode_side(dtype=dtype)
    manager = make(side.addr)
    total = rt.core.kv.num_free_blocks
    for rid, num_tokens in [("small", 5), ("one-block", BLOCK), ("big", 40 * BLOCK - 3)]:
        t, src = hand_off_tiny(manager, rt, rid, num_tokens)
        assert t.state is State.DONE and t.transport == "layers", t.reason
        wait_for(lambda rid=rid: rid in side.admitted, "admission")
        dst = side.blocks(rid)
        assert torch.equal(side.rt.core.kv.kv_cache[:, :, dst], rt.core.kv.kv_cache[:, :, src])
        assert side.admitted[rid].job.prompt_token_ids == [1] * num_tokens
    assert rt.core.kv.num_free_blocks == total  # every source block released


def test_one_steps_asks_go_out_in_one_message_and_are_granted_in_one(prefill, decode_side):
    """Prompts finishing in one engine step ask their decode worker in one HandoffRequests (after the
    step, at the next poll) and get one HandoffGrants back; each lands as a lone ask's would."""
    rt, make = prefill
    side = decode_side()
    manager = make(side.addr)
    asks, replies = [], []
    on_message, on_reply = side.receiver._on_message, manager._on_reply

    def seen_by_decode(frames):  # the real receiver, with the message kinds it handled noted
        asks.append(decode_any(frames[1].bytes))
        on_message(frames)

    def seen_by_prefill(peer, frames):
        replies.append(decode_any(frames[0]))
        on_reply(peer, frames)

    side.receiver._on_message, manager._on_reply = seen_by_decode, seen_by_prefill
    sizes = {"a": 5, "b": 3 * BLOCK, "c": 7 * BLOCK + 1}
    src = {rid: rt.core.kv.reserve(rid, n) for rid, n in sizes.items()}
    for rid, n in sizes.items():  # as the prefill worker does with each prompt its step finished
        manager.prefilled(synthetic_job(rid, n, MODEL), rid.encode(), FirstToken(2))
    ended = poll_until(manager, lambda: len(side.admitted) == len(sizes), "three admissions")
    ended += poll_until(manager, lambda: not manager.transfers, "three acks")
    assert sorted(t.job.request_id for t in ended if t.state is State.DONE) == sorted(sizes)
    requests = [m for m in asks if isinstance(m, HandoffRequest | HandoffRequests)]
    assert len(requests) == 1 and [r.request_id for r in requests[0].requests] == list(sizes)
    grants = [m for m in replies if isinstance(m, HandoffGrant | HandoffGrants)]
    assert len(grants) == 1 and [g.request_id for g in grants[0].grants] == list(sizes)
    for rid in sizes:
        assert torch.equal(side.rt.core.kv.kv_cache[:, :, side.blocks(rid)], rt.core.kv.kv_cache[:, :, src[rid]])


def _dealer(addr: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)  # a peer of the deployment, misbehaving
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 15_000)
    zmq_auth.dial(sock, CURVE)
    sock.connect(addr)
    return sock


def _ask(sock: zmq.Socket, rid: str, num_tokens: int) -> HandoffGrant:
    sock.send(encode(HandoffRequest(rid, MODEL, num_tokens=num_tokens, block_size=BLOCK)))
    grant = decode(sock.recv(), HandoffGrant)
    assert grant.accepted, grant.reason
    return grant


def _header(kv: torch.Tensor, rid: str, grant: HandoffGrant, num_tokens: int, **over) -> KVHeader:
    n = len(grant.block_ids)
    fields = dict(job=synthetic_job(rid, num_tokens, MODEL), **layout_of(kv), num_blocks=n, block_ids=grant.block_ids,
                  nbytes=kv[:, :, :n].numel() * kv.element_size(), first_token_id=2, first_logprob=None,
                  first_top_logprobs=None, prompt_logprobs=None, num_cached_tokens=0, transport="layers",
                  epoch=grant.epoch)
    return KVHeader(**{**fields, **over})


def _layer_messages(kv: torch.Tensor, rid: str, src: list[int], grant: HandoffGrant) -> list[list]:
    staged = StagedKV(kv, src, epoch=grant.epoch)
    return [staged.message(rid, g) for g in range(staged.num_messages)]


def test_corrupted_payloads_are_refused_and_harm_no_other_transfer(prefill, decode_side):
    rt, make = prefill
    side = decode_side()
    kv, total = rt.core.kv.kv_cache, side.rt.core.kv.num_free_blocks
    evil = _dealer(side.addr)
    num_tokens = 30 * BLOCK
    src = list(range(30))

    grant = _ask(evil, "bad-layers", num_tokens)
    messages = _layer_messages(kv, "bad-layers", src, grant)  # one flipped bit in the last layer
    last = bytearray(messages[-1][-1])
    last[-100] ^= 0x01
    messages[-1][-1] = bytes(last)
    for parts in messages:
        evil.send_multipart(parts)
    evil.send(encode(_header(kv, "bad-layers", grant, num_tokens)))
    ack = decode(evil.recv(), HandoffAck)
    assert not ack.ok and "checksum mismatch in layer 7" in ack.reason  # the last of 8

    evil.close()  # its header may draw a second nack (the transfer is gone): the next case on a fresh socket
    evil = _dealer(side.addr)
    grant = _ask(evil, "short", num_tokens)  # every layer intact, the header promises another prompt length
    for parts in _layer_messages(kv, "short", src, grant):
        evil.send_multipart(parts)
    evil.send(encode(_header(kv, "short", grant, num_tokens, job=synthetic_job("short", num_tokens - 1, MODEL))))
    ack = decode(evil.recv(), HandoffAck)
    assert not ack.ok and "prompt length" in ack.reason
    evil.close()
    evil = _dealer(side.addr)

    grant = _ask(evil, "switched", num_tokens)  # layers sent, then a header saying they were written directly
    for parts in _layer_messages(kv, "switched", src, grant):
        evil.send_multipart(parts)
    evil.send(encode(_header(kv, "switched", grant, num_tokens, transport="ipc")))
    ack = decode(evil.recv(), HandoffAck)
    assert not ack.ok and "'ipc' header after 'layers' KV" in ack.reason
    evil.close()
    evil = _dealer(side.addr)

    grant = _ask(evil, "lying", num_tokens)  # claims an IPC write this grant never offered
    evil.send(encode(_header(kv, "lying", grant, num_tokens, transport="ipc")))
    ack = decode(evil.recv(), HandoffAck)
    assert not ack.ok and "IPC" in ack.reason

    wait_for(lambda: side.rt.core.kv.num_free_blocks == total, "the refused transfers' blocks")
    t, src = hand_off_tiny(make(side.addr), rt, "good", num_tokens)
    assert t.state is State.DONE, t.reason
    wait_for(lambda: "good" in side.admitted, "admission")
    assert torch.equal(side.rt.core.kv.kv_cache[:, :, side.blocks("good")], kv[:, :, src])
    assert set(side.admitted) == {"good"}
    evil.close()


def test_decode_peer_that_never_answers_fails_the_transfer(prefill):
    rt, make = prefill
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    zmq_auth.serve(silent, CURVE)
    addr = f"tcp://127.0.0.1:{silent.bind_to_random_port('tcp://127.0.0.1')}"
    total = rt.core.kv.num_free_blocks
    t, _ = hand_off_tiny(make(addr, timeout_s=0.3), rt, "r1", 20)
    assert t.state is State.FAILED and "did not answer" in t.reason and "no other decode worker" in t.reason
    assert rt.core.kv.num_free_blocks == total
    silent.close()


def test_decode_peer_that_stalls_after_granting_fails_the_transfer(prefill):
    rt, make = prefill
    granter = zmq.Context.instance().socket(zmq.ROUTER)
    granter.setsockopt(zmq.LINGER, 0)
    zmq_auth.serve(granter, CURVE)
    addr = f"tcp://127.0.0.1:{granter.bind_to_random_port('tcp://127.0.0.1')}"
    manager = make(addr, timeout_s=0.3)
    total = rt.core.kv.num_free_blocks
    rt.core.kv.reserve("r1", 40 * BLOCK)
    manager.start(synthetic_job("r1", 40 * BLOCK, MODEL), b"r1", FirstToken(2))
    ended, granted = [], False
    while not ended:
        ended = manager.poll(20)
        if not granted and granter.poll(0):  # grant, then read nothing more: the KV has nowhere to go
            peer, _ = granter.recv_multipart()
            granter.send_multipart([peer, encode(HandoffGrant("r1", accepted=True, block_ids=list(range(40))))])
            granted = True
    assert ended[0].state is State.FAILED and "within" in ended[0].reason
    assert rt.core.kv.num_free_blocks == total  # released once nothing read them any more
    granter.close()


def test_the_sender_stamps_its_grants_epoch_and_takes_no_answer_about_another_grant(prefill):
    """Every KV message and the header carry the grant's epoch; a nack about an earlier grant of the same request
    (its header, say, arriving after the request was granted again) does not fail the transfer of this one."""
    rt, make = prefill
    granter = zmq.Context.instance().socket(zmq.ROUTER)
    granter.setsockopt(zmq.LINGER, 0)
    zmq_auth.serve(granter, CURVE)
    addr = f"tcp://127.0.0.1:{granter.bind_to_random_port('tcp://127.0.0.1')}"
    manager = make(addr)
    rt.core.kv.reserve("r1", 4 * BLOCK)
    manager.start(synthetic_job("r1", 4 * BLOCK, MODEL), b"r1", FirstToken(2))
    layers, header, ended = [], None, []
    while header is None:
        ended += manager.poll(20)
        while granter.poll(0):
            peer, raw, *frames = granter.recv_multipart()
            msg = decode_any(raw, HandoffRequest, KVLayers, KVHeader)
            if isinstance(msg, HandoffRequest):
                grant = HandoffGrant("r1", accepted=True, block_ids=[7, 8, 9, 10], ttl_s=5.0, epoch=5)
                granter.send_multipart([peer, encode(grant)])
            elif isinstance(msg, KVLayers):
                layers.append(msg)
            else:
                header = msg
    assert layers and {m.epoch for m in layers} == {5} and header.epoch == 5
    granter.send_multipart([peer, encode(HandoffAck("r1", ok=False, reason="no grant for this request", epoch=4))])
    granter.send_multipart([peer, encode(HandoffAck("r1", ok=True, epoch=5))])
    ended += poll_until(manager, lambda: not manager.transfers, "the ack")
    assert [(t.state, t.reason) for t in ended] == [(State.DONE, "")]
    granter.close()


def test_prefill_peer_that_stalls_mid_transfer_times_out_on_the_decode_side(prefill, decode_side):
    rt, make = prefill
    side = decode_side(ttl_s=1.0)
    kv, total = rt.core.kv.kv_cache, side.rt.core.kv.num_free_blocks
    stalled = _dealer(side.addr)
    num_tokens = 40 * BLOCK
    messages = _layer_messages(kv, "half", list(range(40)), _ask(stalled, "half", num_tokens))
    assert len(messages) > 1
    stalled.send_multipart(messages[0])  # ... and nothing more
    ack = decode(stalled.recv(), HandoffAck)
    assert not ack.ok and "stalled" in ack.reason
    stalled.send_multipart(messages[1])  # the rest, too late: ignored, not a crash
    wait_for(lambda: side.rt.core.kv.num_free_blocks == total, "the stalled transfer's blocks")
    t, src = hand_off_tiny(make(side.addr), rt, "after", BLOCK)
    assert t.state is State.DONE, t.reason
    wait_for(lambda: "after" in side.admitted, "admission")
    assert torch.equal(side.rt.core.kv.kv_cache[:, :, side.blocks("after")], kv[:, :, src])
    stalled.close()


# -- early grants and layers streamed during the prompt's last chunk --------------------------------------
def test_layers_streamed_during_the_last_chunk_land_before_their_header(prefill, decode_side):
    """An early grant, then the forward writes the prompt's KV layer by layer: each group of layers is
    staged and sent as soon as its last layer is written, before the first token (and so the header)
    exists; the header comes last and the KV lands bit-exact."""
    rt, make = prefill
    side = decode_side()
    manager = make(side.addr)
    kv = rt.core.kv.kv_cache
    final = kv.clone()
    num_tokens = 40 * BLOCK - 3  # 10 MiB: several messages of a few layers
    src = rt.core.kv.reserve("s", num_tokens)
    kv[:, :, src] = 0  # not computed yet
    t = early(manager, "s", num_tokens)
    poll_until(manager, lambda: t.state is State.GRANTED, "the early grant")
    assert not t.holds_source and len(side.blocks("s")) == len(src)  # the decode side reserved them
    stream = manager.stream_for(MODEL)
    assert stream.begin([("s", src), ("unknown", src)])  # only transfers holding a grant stream
    assert t.state is State.STREAMING and stream.streaming == [t]
    sender = t.sender
    assert 1 < sender.num_messages < SHAPE[0]
    for layer in range(SHAPE[0]):  # the forward
        kv[layer, :, src] = final[layer, :, src]
        stream.layer_done(layer)
    stream.end()
    poll_until(manager, lambda: sender.sent == sender.num_messages, "every group sent")
    wait_for(lambda: "s" in side.receiver.incoming and side.receiver.incoming["s"].receiver.complete,
              "the layers written on the decode side")
    assert side.receiver.incoming["s"].header is None and "s" not in side.admitted  # no first token yet
    assert manager.complete("s", FirstToken(7, logprob=-0.5))
    ended = poll_until(manager, lambda: "s" not in manager.transfers, "the ack")
    assert [e.state for e in ended] == [State.DONE] and ended[0].streamed and ended[0].transport == "layers"
    wait_for(lambda: "s" in side.admitted, "admission")
    assert side.admitted["s"].first_token_id == 7 and side.admitted["s"].first_logprob == -0.5
    assert torch.equal(side.rt.core.kv.kv_cache[:, :, side.blocks("s")], final[:, :, src])
    assert not rt.core.kv.block_ids("s")  # our blocks went back once staged


def test_overlap_benchmark_runs_both_paths_through_a_real_engine():
    """``kvrelay bench handoff --sections overlap`` at a toy size, as its own process (benchmarks and
    tests never import each other): a real prefill engine, a decode-side process, each prompt handed
    off both ways (the benchmark raises unless each ended DONE the way it was meant to)."""
    proc = subprocess.run([sys.executable, "-m", "kvrelay.bench.handoff", "--sections", "overlap", "--overlap-model",
                           "dummy:tiny-llama", "--overlap-tokens", "40,100", "--repeats", "1", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| 40 ") or line.startswith("| 100 ")]
    assert [r[0] for r in rows] == ["| 40", "| 100"] and all(len(r) == 10 for r in rows)
