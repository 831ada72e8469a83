"""The KV handoff over real ZMQ sockets: a real HandoffManager (prefill side) in the test thread, a real
HandoffReceiver (decode side) in another, or a hand-driven socket where a test needs a peer that
misbehaves (corrupts a payload, stalls). Neither side needs an engine: ``bench.handoff.endpoint`` gives
each a KV cache and a block manager, which is all the handoff touches."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch
import zmq
from kvrelay.bench.handoff import decode_info, endpoint, transfer
from kvrelay.decode_worker import receiver as receiver_module
from kvrelay.decode_worker.receiver import HandoffReceiver
from kvrelay.prefill_worker.handoff import HandoffManager, State
from kvrelay.shared.handoff.frames import StagedKV, layout_of, max_message_bytes, pack_blocks
from kvrelay.shared.wire.protocol import (
    HandoffAck,
    HandoffGrant,
    HandoffRequest,
    KVHeader,
    KVIpcHandle,
    KVLayers,
    decode,
    encode,
    kv_checksum,
)

MODEL = "tiny"
SHAPE = (8, 2, 96, 16, 4, 64)  # fp32: 256 KiB a block, so 10 MiB transfers go through the thread pool
BLOCK = SHAPE[3]


class DecodeSide:
    """A decode worker's handoff half on its own thread; admitted requests keep their blocks."""

    def __init__(self, kv: torch.Tensor, ttl_s: float = 5.0):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes(kv, kv.shape[2]))  # as the decode worker
        self.addr = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.rt = endpoint(kv, "d1", MODEL)
        self.receiver = HandoffReceiver(self.sock, self.rt.core, MODEL, ttl_s)
        self.admitted: dict[str, KVHeader] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.receiver.poll(20, lambda h: self.admitted.setdefault(h.request_id, h))

    def blocks(self, rid: str) -> list[int]:
        return self.rt.core.block_manager.block_ids(rid)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.ctx.destroy(linger=0)


@pytest.fixture()
def prefill():
    kv = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    rt = endpoint(kv, "p1", MODEL, scatter_seed=3)
    ctx = zmq.Context()
    managers = []

    def make(addr: str, timeout_s: float = 5.0) -> HandoffManager:
        managers.append(HandoffManager(ctx, rt, timeout_s, workers=lambda: [decode_info(addr, model=MODEL)]))
        return managers[-1]

    yield rt, make
    for m in managers:
        m.close()
    ctx.destroy(linger=0)


@pytest.fixture()
def decode_side():
    sides = []

    def make(dtype=torch.float32, **kw) -> DecodeSide:
        sides.append(DecodeSide(torch.zeros(SHAPE, dtype=dtype), **kw))
        return sides[-1]

    yield make
    for side in sides:
        side.close()


def _hand_off(manager: HandoffManager, rt, rid: str, num_tokens: int):
    src = rt.core.block_manager.allocate_for_tokens(rid, num_tokens)
    manager.start(transfer(rid, num_tokens, MODEL))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for t in manager.poll(20):
            if t.job.request_id == rid:
                return t, src
    raise AssertionError(f"{rid} never ended")


def _wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_handoffs_land_bit_exact(prefill, decode_side, dtype):
    """bf16 halves a layer, so the big transfer packs more layers into a message than one layer of the
    whole cache: the receive bound must allow for that (it once did not)."""
    rt, make = prefill
    rt.core.runner.kv_cache = rt.core.runner.kv_cache.to(dtype)
    side = decode_side(dtype=dtype)
    manager = make(side.addr)
    total = rt.core.block_manager.num_free_blocks
    for rid, num_tokens in [("small", 5), ("one-block", BLOCK), ("big", 40 * BLOCK - 3)]:
        t, src = _hand_off(manager, rt, rid, num_tokens)
        assert t.state is State.DONE and t.transport == "layers", t.reason
        _wait_for(lambda rid=rid: rid in side.admitted, "admission")
        dst = side.blocks(rid)
        assert torch.equal(side.rt.core.runner.kv_cache[:, :, dst], rt.core.runner.kv_cache[:, :, src])
        assert side.admitted[rid].prompt_token_ids == [1] * num_tokens
    assert rt.core.block_manager.num_free_blocks == total  # every source block released


def _dealer(addr: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 15_000)
    sock.connect(addr)
    return sock


def _ask(sock: zmq.Socket, rid: str, num_tokens: int) -> HandoffGrant:
    sock.send(encode(HandoffRequest(rid, MODEL, num_tokens=num_tokens, block_size=BLOCK, prefill_addr="")))
    grant = decode(sock.recv(), HandoffGrant)
    assert grant.accepted, grant.reason
    return grant


def _header(kv: torch.Tensor, rid: str, grant: HandoffGrant, num_tokens: int, **over) -> KVHeader:
    n = len(grant.block_ids)
    fields = dict(request_id=rid, model=MODEL, **layout_of(kv), num_blocks=n, block_ids=grant.block_ids,
                  num_frames=kv.shape[0], nbytes=kv[:, :, :n].numel() * kv.element_size(), checksum=0,
                  prompt_token_ids=[1] * num_tokens, first_token_id=2, first_logprob=None, first_top_logprobs=None,
                  prompt_logprobs=None, num_cached_tokens=0, sampling={}, tenant="t", priority=0, reply_addr="",
                  deadline=0.0, arrival=0.0, transport="layers")
    return KVHeader(**{**fields, **over})


def _layer_messages(kv: torch.Tensor, rid: str, src: list[int]) -> list[list]:
    staged = StagedKV(kv, src)
    out = []
    for g in range(staged.num_messages):
        frame, crcs = staged.result(g)
        msg = KVLayers(rid, first=g * staged.per_message, nbytes=staged.layer_nbytes, checksums=crcs)
        out.append([encode(msg), frame])
    return out


def test_corrupted_payloads_are_refused_and_harm_no_other_transfer(prefill, decode_side):
    rt, make = prefill
    side = decode_side()
    kv, total = rt.core.runner.kv_cache, side.rt.core.block_manager.num_free_blocks
    evil = _dealer(side.addr)
    num_tokens = 30 * BLOCK
    src = list(range(30))

    messages = _layer_messages(kv, "bad-layers", src)  # one flipped bit in the last layer
    grant = _ask(evil, "bad-layers", num_tokens)
    last = bytearray(messages[-1][-1])
    last[-100] ^= 0x01
    messages[-1][-1] = bytes(last)
    evil.send(encode(_header(kv, "bad-layers", grant, num_tokens)))
    for parts in messages:
        evil.send_multipart(parts)
    ack = decode(evil.recv(), HandoffAck)
    assert not ack.ok and "checksum mismatch in layer 7" in ack.reason  # the last of 8

    grant = _ask(evil, "bad-frames", num_tokens)  # the one-message form, same check
    frames = pack_blocks(kv, src)
    header = _header(kv, "bad-frames", grant, num_tokens, transport="frames", checksum=kv_checksum(frames) ^ 1)
    evil.send_multipart([encode(header), *frames])
    ack = decode(evil.recv(), HandoffAck)
    assert not ack.ok and "checksum" in ack.reason

    grant = _ask(evil, "lying", num_tokens)  # claims an IPC write this grant never offered
    evil.send(encode(_header(kv, "lying", grant, num_tokens, transport="ipc", num_frames=0)))
    ack = decode(evil.recv(), HandoffAck)
    assert not ack.ok and "IPC" in ack.reason

    _wait_for(lambda: side.rt.core.block_manager.num_free_blocks == total, "the refused transfers' blocks")
    t, src = _hand_off(make(side.addr), rt, "good", num_tokens)
    assert t.state is State.DONE, t.reason
    _wait_for(lambda: "good" in side.admitted, "admission")
    assert torch.equal(side.rt.core.runner.kv_cache[:, :, side.blocks("good")], kv[:, :, src])
    assert set(side.admitted) == {"good"}
    evil.close()


def test_decode_peer_that_never_answers_fails_the_transfer(prefill):
    rt, make = prefill
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    addr = f"tcp://127.0.0.1:{silent.bind_to_random_port('tcp://127.0.0.1')}"
    total = rt.core.block_manager.num_free_blocks
    t, _ = _hand_off(make(addr, timeout_s=0.3), rt, "r1", 20)
    assert t.state is State.FAILED and "did not answer" in t.reason and "no other decode worker" in t.reason
    assert rt.core.block_manager.num_free_blocks == total
    silent.close()


def test_decode_peer_that_stalls_after_granting_fails_the_transfer(prefill):
    rt, make = prefill
    granter = zmq.Context.instance().socket(zmq.ROUTER)
    granter.setsockopt(zmq.LINGER, 0)
    addr = f"tcp://127.0.0.1:{granter.bind_to_random_port('tcp://127.0.0.1')}"
    manager = make(addr, timeout_s=0.3)
    total = rt.core.block_manager.num_free_blocks
    rt.core.block_manager.allocate_for_tokens("r1", 40 * BLOCK)
    manager.start(transfer("r1", 40 * BLOCK, MODEL))
    ended, granted = [], False
    while not ended:
        ended = manager.poll(20)
        if not granted and granter.poll(0):  # grant, then read nothing more: the KV has nowhere to go
            peer, _ = granter.recv_multipart()
            granter.send_multipart([peer, encode(HandoffGrant("r1", accepted=True, block_ids=list(range(40))))])
            granted = True
    assert ended[0].state is State.FAILED and "within" in ended[0].reason
    assert rt.core.block_manager.num_free_blocks == total  # released once nothing read them any more
    granter.close()


def test_prefill_peer_that_stalls_mid_transfer_times_out_on_the_decode_side(prefill, decode_side):
    rt, make = prefill
    side = decode_side(ttl_s=1.0)
    kv, total = rt.core.runner.kv_cache, side.rt.core.block_manager.num_free_blocks
    stalled = _dealer(side.addr)
    num_tokens = 40 * BLOCK
    messages = _layer_messages(kv, "half", list(range(40)))
    assert len(messages) > 1
    grant = _ask(stalled, "half", num_tokens)
    stalled.send(encode(_header(kv, "half", grant, num_tokens)))
    stalled.send_multipart(messages[0])  # ... and nothing more
    ack = decode(stalled.recv(), HandoffAck)
    assert not ack.ok and "stalled" in ack.reason
    stalled.send_multipart(messages[1])  # the rest, too late: ignored, not a crash
    _wait_for(lambda: side.rt.core.block_manager.num_free_blocks == total, "the stalled transfer's blocks")
    t, src = _hand_off(make(side.addr), rt, "after", BLOCK)
    assert t.state is State.DONE, t.reason
    _wait_for(lambda: "after" in side.admitted, "admission")
    assert torch.equal(side.rt.core.runner.kv_cache[:, :, side.blocks("after")], kv[:, :, src])
    stalled.close()


def test_blocks_offered_through_ipc_stay_parked_one_more_ttl(monkeypatch):
    """An asker that got an IPC handle may still be writing when its grant lapses or is superseded, so
    those blocks are not reused until a second TTL has passed (the asker only writes within half of one)."""
    now = [1000.0]
    monkeypatch.setattr(receiver_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    side = endpoint(torch.zeros(SHAPE), "d1", MODEL)
    bm, total = side.core.block_manager, side.core.block_manager.num_free_blocks
    ctx = zmq.Context()
    router, asker = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    addr = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    asker.connect(addr)
    receiver = HandoffReceiver(router, side.core, MODEL, grant_ttl_s=10.0)
    handle = KVIpcHandle(device_uuid="GPU-x", handle=b"\x01" * 64, storage_size=1, storage_offset=0,
                         ref_counter=b"/torch_1", ref_counter_offset=0, event_handle=None,
                         event_sync_required=False, tensor_offset=0, shape=list(SHAPE), stride=[1] * 6,
                         dtype="float32")
    exporter = SimpleNamespace(offer=lambda requester, uuid: handle)  # as if the asker shared our GPU
    receiver.exporters[MODEL] = exporter

    def ask() -> HandoffGrant:
        asker.send(encode(HandoffRequest("r", MODEL, num_tokens=4 * BLOCK, block_size=BLOCK, prefill_addr="",
                                         device_uuid="GPU-x", requester="p1")))
        while not asker.poll(0):
            receiver.poll(100, admit=None)
        return decode(asker.recv(), HandoffGrant)

    first = ask()
    assert first.ipc == handle and first.ttl_s == 10.0
    second = ask()  # the job was reclaimed by a peer: the newer asker wins, the old blocks stay parked
    assert second.accepted and set(second.block_ids).isdisjoint(first.block_ids)
    assert bm.num_free_blocks == total - 8
    now[0] += 10.5  # the second grant lapses (parked); the first's parking is over (freed)
    receiver.poll(0, admit=None)
    assert "r" not in receiver.grants and bm.num_free_blocks == total - 4
    assert not set(bm.block_ids("r"))
    now[0] += 10.5
    receiver.poll(0, admit=None)
    assert bm.num_free_blocks == total
    ctx.destroy(linger=0)


# -- early grants and layers streamed during the prompt's last chunk --------------------------------------
def _poll_until(manager: HandoffManager, cond, what: str) -> list:
    ended: list = []
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        ended += manager.poll(20)
    return ended


def _early(manager: HandoffManager, rid: str, num_tokens: int):
    manager.start_early(transfer(rid, num_tokens, MODEL).job, rid.encode())
    return manager.transfers[rid]


def test_layers_streamed_during_the_last_chunk_land_before_their_header(prefill, decode_side):
    """An early grant, then the forward writes the prompt's KV layer by layer: each group of layers is
    staged and sent as soon as its last layer is written, before the first token (and so the header)
    exists; the header comes last and the KV lands bit-exact."""
    rt, make = prefill
    side = decode_side()
    manager = make(side.addr)
    kv = rt.core.runner.kv_cache
    final = kv.clone()
    num_tokens = 40 * BLOCK - 3  # 10 MiB: several messages of a few layers
    src = rt.core.block_manager.allocate_for_tokens("s", num_tokens)
    kv[:, :, src] = 0  # not computed yet
    t = _early(manager, "s", num_tokens)
    _poll_until(manager, lambda: t.state is State.GRANTED, "the early grant")
    assert not t.holds_source and len(side.blocks("s")) == len(src)  # the decode side reserved them
    stream = manager.stream_for(MODEL)
    assert stream.begin([("s", src), ("unknown", src)])  # only transfers holding a grant stream
    assert t.state is State.STREAMING and stream.streaming == [t]
    per = t.sender.per_message
    assert 1 < t.sender.num_messages < SHAPE[0]
    for layer in range(SHAPE[0]):  # the forward
        kv[layer, :, src] = final[layer, :, src]
        stream.layer_done(layer)
    stream.end()
    _poll_until(manager, lambda: t.next_group == t.sender.num_messages, "every group sent")
    _wait_for(lambda: "s" in side.receiver.incoming and side.receiver.incoming["s"].assembler.complete,
              "the layers written on the decode side")
    assert side.receiver.incoming["s"].header is None and "s" not in side.admitted  # no first token yet
    assert manager.complete("s", first_token=7, first_logprob=-0.5, first_top=None, num_cached_tokens=0)
    ended = _poll_until(manager, lambda: "s" not in manager.transfers, "the ack")
    assert [e.state for e in ended] == [State.DONE] and ended[0].streamed and per
    _wait_for(lambda: "s" in side.admitted, "admission")
    assert side.admitted["s"].first_token_id == 7 and side.admitted["s"].first_logprob == -0.5
    assert torch.equal(side.rt.core.runner.kv_cache[:, :, side.blocks("s")], final[:, :, src])
    assert not rt.core.block_manager.block_ids("s")  # our blocks went back once staged


def test_early_grants_are_cancelled_or_parked_never_left_to_expire(prefill, decode_side):
    """A prompt that ends at its first token, or one aborted mid-stream, cancels its grant (the decode
    side frees the blocks at once); one refused early, or whose grant went stale while it waited, asks
    again once computed and lands."""
    rt, make = prefill
    side = decode_side(ttl_s=1.0)
    manager = make(side.addr)
    bm = side.rt.core.block_manager
    total = bm.num_free_blocks
    t = _early(manager, "eos", 4 * BLOCK)
    _poll_until(manager, lambda: t.state is State.GRANTED, "a grant")
    assert bm.num_free_blocks == total - 4
    manager.cancel("eos")  # it ended at its first token
    _wait_for(lambda: bm.num_free_blocks == total, "the cancelled grant's blocks")

    src = rt.core.block_manager.allocate_for_tokens("aborted", 40 * BLOCK)
    t = _early(manager, "aborted", 40 * BLOCK)
    _poll_until(manager, lambda: t.state is State.GRANTED, "a grant")
    stream = manager.stream_for(MODEL)
    assert stream.begin([("aborted", src)])
    stream.layer_done(t.sender.per_message - 1)  # the first group of layers is written
    _poll_until(manager, lambda: "aborted" in side.receiver.incoming, "the first streamed layers")
    assert t.next_group == 1
    stream.end()
    manager.cancel("aborted")  # the client went away: the half-received KV is dropped
    _wait_for(lambda: bm.num_free_blocks == total and not side.receiver.incoming, "the dropped transfer")
    rt.core.block_manager.free("aborted")

    hog = bm.allocate_for_tokens("hog", (total - 2) * BLOCK)  # the decode side is nearly full
    src = rt.core.block_manager.allocate_for_tokens("refused", 4 * BLOCK)
    t = _early(manager, "refused", 4 * BLOCK)
    _poll_until(manager, lambda: t.state is State.PARKED, "the refusal")
    bm.free("hog")
    assert hog
    stale = _early(manager, "stale", 4 * BLOCK)
    stale_src = rt.core.block_manager.allocate_for_tokens("stale", 4 * BLOCK)
    _poll_until(manager, lambda: stale.state is State.GRANTED, "a grant")
    time.sleep(0.6)  # half the grant's TTL: the prompt is still queued, so the grant goes back
    _poll_until(manager, lambda: stale.state is State.PARKED, "the stale grant cancelled")
    _wait_for(lambda: bm.num_free_blocks == total, "the stale grant's blocks")
    for rid in ("refused", "stale"):
        assert manager.complete(rid, first_token=3, first_logprob=None, first_top=None, num_cached_tokens=0)
    ended = _poll_until(manager, lambda: not manager.transfers, "both handoffs")
    assert sorted((e.job.request_id, e.state, e.streamed) for e in ended) == [
        ("refused", State.DONE, False), ("stale", State.DONE, False)]
    _wait_for(lambda: {"refused", "stale"} <= set(side.admitted), "admission")
    for rid, blocks in (("refused", src), ("stale", stale_src)):
        assert torch.equal(side.rt.core.runner.kv_cache[:, :, side.blocks(rid)], rt.core.runner.kv_cache[:, :, blocks])


def test_overlap_benchmark_runs_both_paths_through_a_real_engine():
    """``kvrelay bench handoff --sections overlap`` at a toy size: a real prefill engine, a decode-side
    process, each prompt handed off both ways (it raises unless each ended DONE the way it was meant to)."""
    from kvrelay.bench.handoff import _overlap

    result = _overlap("cpu", "dummy:tiny-llama", [40, 100], repeats=1)
    assert sorted(result) == [40, 100]
    assert all(len(m[False]) == len(m[True]) == 3 for m in result.values())
