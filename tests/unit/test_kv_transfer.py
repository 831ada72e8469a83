"""shared/handoff/frames.py and the CPU-checkable parts of shared/handoff/cuda_ipc.py: KV blocks survive every wire
form bit for bit, and every way a transfer can be wrong is refused before a byte lands in the cache."""

import dataclasses
from concurrent.futures import wait

import msgpack
import pytest
import torch

from kvrelay.shared.handoff import frames as kt
from kvrelay.shared.handoff.blocks import block_runs, check_layout, copy_blocks, frame_nbytes, layout_of
from kvrelay.shared.handoff.cuda_ipc import CudaIpc, check_handle
from kvrelay.shared.handoff.direct import Exporter, IpcError
from kvrelay.shared.handoff.waker import Waker
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.handoff import HandoffGrant, KVHeader, KVIpcHandle, KVLayers
from kvrelay.shared.wire.limits import IGNORABLE_KEY
from kvrelay.shared.wire.protocol import Job
from kvrelay.shared.wire.sampling_params import SamplingParams

SHAPE = (3, 2, 10, 4, 2, 8)  # [L, 2, N, bs, Hkv, D]
SRC_BLOCKS, DST_BLOCKS = [3, 7, 1], [0, 9, 5]


def _cache(seed: int = 0, dtype=torch.float32, shape=SHAPE) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _header(kv: torch.Tensor, **over) -> KVHeader:
    n = len(DST_BLOCKS)
    job = Job(request_id="r", model="m", prompt_token_ids=[1] * (n * kv.shape[3]), sampling=SamplingParams(),
              tenant="t", priority=0, reply_addr="", deadline=0.0, arrival=0.0)
    base = dict(job=job, **layout_of(kv), num_blocks=n, block_ids=DST_BLOCKS, transport="layers",
                nbytes=kv.shape[0] * frame_nbytes(kv, n), first_token_id=2, first_logprob=None,
                first_top_logprobs=None, prompt_logprobs=None, num_cached_tokens=0)
    return KVHeader(**{**base, **over})


def _blocks(kv: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return kv[:, :, ids]


@pytest.mark.parametrize(("over", "match"), [
    (dict(num_kv_heads=4), "layout mismatch"),
    (dict(dtype="float16"), "layout mismatch"),
    (dict(num_layers=2), "layout mismatch"),
    (dict(nbytes=1), "promises 1 bytes"),
    (dict(block_ids=[0, 9, 10]), "out of range"),
], ids=["heads", "dtype", "layers", "total bytes", "block id"])
def test_check_layout_refuses_a_header_that_does_not_fit(over, match):
    kv = _cache()
    check_layout(kv, _header(kv))
    with pytest.raises(ValueError, match=match):
        check_layout(kv, _header(kv, **over))


def test_a_tensor_parallel_rank_checks_headers_against_every_kv_head_of_the_model():
    """A rank's cache holds half the heads at TP 2; blocks travel with all of them, so the header must
    state the model's count: one stating the rank's share (a sender that moved only its own heads) is refused."""
    full, rank = _cache(), _cache(shape=SHAPE[:4] + (1,) + SHAPE[5:])
    check_layout(rank, _header(full), num_kv_heads=2)
    with pytest.raises(ValueError, match=r"KV layout mismatch \(sent, expected\): \{'num_kv_heads': \(1, 2\)\}"):
        check_layout(rank, _header(rank), num_kv_heads=2)


def test_a_pipeline_stage_checks_headers_against_every_layer_of_the_model():
    """Stage 0's cache holds its own layers; blocks travel with all of them, so a header stating one stage's
    layers (a sender that moved only its own stage) is refused."""
    full, stage = _cache(), _cache(shape=(1,) + SHAPE[1:])
    check_layout(stage, _header(full), num_layers=SHAPE[0])
    with pytest.raises(ValueError, match=rf"KV layout mismatch \(sent, expected\): \{{'num_layers': \(1, {SHAPE[0]}\)\}}"):
        check_layout(stage, _header(stage), num_layers=SHAPE[0])


def test_header_names_one_of_the_live_transports():
    kv = _cache()
    for transport in ("layers", "ipc"):
        assert decode(encode(_header(kv, transport=transport)), KVHeader).transport == transport
    for dead in ("frames", "carrier-pigeon"):  # "frames", the one-message form, went with its last sender
        with pytest.raises(ValueError, match="transport"):
            decode(encode(dataclasses.replace(_header(kv), transport=dead)), KVHeader)


# -- "layers" -------------------------------------------------------------------------------------------
def _stage(src: torch.Tensor, blocks=SRC_BLOCKS) -> list[tuple[KVLayers, bytes]]:
    staged = kt.StagedKV(src, blocks)
    msgs = []
    for g in range(staged.num_messages):
        msg, frame = staged.message("r", g)
        msgs.append((decode(msg, KVLayers), frame))
    assert staged.source_free()
    return msgs


@pytest.mark.parametrize("shape", [SHAPE, (40, 2, 16, 16, 8, 64)], ids=["inline-one-message", "pool-many-messages"])
@pytest.mark.parametrize("dst_blocks", [[8, 0, 1, 6], [0, 1, 2, 3]], ids=["scattered", "contiguous"])
def test_staged_layers_round_trip(shape, dst_blocks):
    src, dst = _cache(1, torch.bfloat16, shape), torch.zeros(shape, dtype=torch.bfloat16)
    src_blocks = [5, 2, 9, 3]
    msgs = _stage(src, src_blocks)
    assert (len(msgs) > 1) == (shape != SHAPE)
    asm = kt.LayerAssembler(dst, dst_blocks)
    for msg, frame in msgs:
        assert not asm.complete
        asm.add(msg, [frame])
    wait(asm.futures)
    assert asm.complete and asm.error() is None
    asm.finish()
    assert torch.equal(_blocks(dst, dst_blocks), _blocks(src, src_blocks))


def test_layer_assembler_refuses_bad_layers():
    src = _cache(2)
    (msg, frame), = _stage(src)
    assert len(msg.checksums) == 3 and frame.nbytes == 3 * msg.nbytes

    def fresh():
        return kt.LayerAssembler(torch.zeros(SHAPE), DST_BLOCKS)

    with pytest.raises(ValueError, match="KV layers 1..3 arrived again or past the 3 layers"):
        fresh().add(dataclasses.replace(msg, first=1), [frame])
    with pytest.raises(ValueError, match="2 frames, not 1"):
        fresh().add(msg, [frame, frame])
    with pytest.raises(ValueError, match="expected"):
        fresh().add(dataclasses.replace(msg, nbytes=msg.nbytes - 1), [frame])
    with pytest.raises(ValueError, match="expected"):
        fresh().add(msg, [bytes(frame)[:-1]])
    with pytest.raises(ValueError, match="past the 3 layers"):
        fresh().add(dataclasses.replace(msg, checksums=msg.checksums * 2), [bytes(frame) * 2])
    asm = fresh()  # a corrupt layer: noticed by the writer, reported through error(), nothing read
    corrupt = bytearray(frame)
    corrupt[2 * msg.nbytes] ^= 1
    asm.add(msg, [bytes(corrupt)])
    asm.abandon()
    assert "checksum mismatch in layer 2" in str(asm.error())
    with pytest.raises(ValueError, match="expected"):  # layers of another dtype: sizes differ
        kt.LayerAssembler(torch.zeros(SHAPE, dtype=torch.float16), DST_BLOCKS).add(msg, [frame])


def test_macd_layers_round_trip_and_a_frame_under_another_key_lands_nothing():
    shape = (40, 2, 16, 16, 8, 64)
    src, key = _cache(4, torch.bfloat16, shape), bytes(range(32))
    staged = kt.StagedKV(src, [5, 2, 9, 3], key=key)
    msgs = [decode(staged.message("r", g)[0], KVLayers) for g in range(staged.num_messages)]
    frames = [staged.result(g)[0] for g in range(staged.num_messages)]
    assert len(msgs) > 1 and all(len(m.mac) == 32 and not m.checksums for m in msgs)
    dst = torch.zeros(shape, dtype=torch.bfloat16)
    asm = kt.LayerAssembler(dst, [8, 0, 1, 6], key=key)
    for msg, frame in zip(msgs, frames, strict=True):
        asm.add(msg, [frame])
    wait(asm.futures)
    assert asm.complete and asm.error() is None
    assert torch.equal(_blocks(dst, [8, 0, 1, 6]), _blocks(src, [5, 2, 9, 3]))
    other = torch.zeros(shape, dtype=torch.bfloat16)
    asm = kt.LayerAssembler(other, [8, 0, 1, 6], key=bytes(32))
    asm.add(msgs[0], [frames[0]])
    asm.abandon()
    assert "MAC mismatch" in str(asm.error()) and not other.any()
    with pytest.raises(ValueError, match="gave no key"):  # a grant without a key takes CRC'd frames only
        kt.LayerAssembler(other, [8, 0, 1, 6]).add(msgs[0], [frames[0]])


def test_layers_assemble_in_any_order_but_a_layer_only_once():
    """Frames dealt across several bulk sockets arrive in whatever order the sockets deliver them: each is placed by
    the layers it names; one naming a layer already taken fails the transfer."""
    shape = (24, 2, 10, 16, 32, 64)  # 512 KiB a layer of 4 blocks: 3 messages of 8 layers
    src, key = _cache(5, torch.bfloat16, shape), bytes(range(32))
    staged = kt.StagedKV(src, [5, 2, 9, 3], key=key)
    msgs = [decode(staged.message("r", g)[0], KVLayers) for g in range(staged.num_messages)]
    frames = [staged.result(g)[0] for g in range(staged.num_messages)]
    assert len(msgs) > 2
    dst = torch.zeros(shape, dtype=torch.bfloat16)
    asm = kt.LayerAssembler(dst, [8, 0, 1, 6], key=key)
    order = [len(msgs) - 1, 0, *range(len(msgs) - 2, 0, -1)]  # the last first, then the first, then backwards
    for g in order:
        assert not asm.all_arrived
        asm.add(msgs[g], [frames[g]])
    wait(asm.futures)
    assert asm.complete and asm.error() is None
    assert torch.equal(_blocks(dst, [8, 0, 1, 6]), _blocks(src, [5, 2, 9, 3]))
    asm = kt.LayerAssembler(torch.zeros(shape, dtype=torch.bfloat16), [8, 0, 1, 6], key=key)
    asm.add(msgs[1], [frames[1]])
    with pytest.raises(ValueError, match=f"KV layers {msgs[1].first}..{msgs[2].first - 1} arrived again"):
        asm.add(msgs[1], [frames[1]])


@pytest.mark.parametrize("over", [dict(checksums=[1]), dict(mac=b"short"), dict(heads=[0, 1], requester="p")],
                         ids=["and checksums", "short", "a part"])
def test_a_mac_is_32_bytes_for_whole_layers_instead_of_checksums(over):
    msg = KVLayers(request_id="r", first=0, nbytes=8, checksums=[], mac=bytes(32))
    assert decode(encode(msg), KVLayers).mac == bytes(32)
    with pytest.raises(ValueError, match="MAC of 32 bytes"):
        decode(encode(dataclasses.replace(msg, **over)), KVLayers)
    with pytest.raises(ValueError, match="1..4096 checksums"):  # neither
        decode(encode(dataclasses.replace(msg, mac=b"")), KVLayers)


def test_a_grant_names_a_bulk_socket_with_its_key_or_neither():
    grant = HandoffGrant(request_id="r", accepted=True, frames_addr="tcp://h:1", frames_key=bytes(32))
    assert decode(encode(grant), HandoffGrant).frames_key == bytes(32) and "frames_key" not in repr(grant)
    for over in (dict(frames_key=b""), dict(frames_addr=""), dict(frames_key=bytes(16)), dict(frames_addr="h:1")):
        with pytest.raises(ValueError, match="frames_"):
            decode(encode(dataclasses.replace(grant, **over)), HandoffGrant)


def test_a_grant_names_more_bulk_sockets_only_beside_the_first():
    grant = HandoffGrant(request_id="r", accepted=True, frames_addr="tcp://h:1", frames_key=bytes(32),
                         more_frames_addrs=["tcp://h:2", "ipc:///tmp/b3"])
    assert decode(encode(grant), HandoffGrant).frames_addrs == ["tcp://h:1", "tcp://h:2", "ipc:///tmp/b3"]
    # an asker that predates it may drop it (and sends every frame to frames_addr, one of the same sockets)
    assert "more_frames_addrs" in msgpack.unpackb(encode(grant))[IGNORABLE_KEY]
    for over in (dict(frames_addr="", frames_key=b""), dict(more_frames_addrs=["h:2"]),
                 dict(more_frames_addrs=[f"tcp://h:{i}" for i in range(2, 18)])):
        with pytest.raises(ValueError, match="more_frames_addrs"):
            decode(encode(dataclasses.replace(grant, **over)), HandoffGrant)


def test_deferred_staging_follows_the_layers_written():
    """The layer-by-layer overlap: a group is staged only once ``stage_through`` says the prefill wrote
    its last layer, and what it stages is the cache as of then (later writes to other layers are not
    in it, this layer's are)."""
    shape = (40, 2, 16, 16, 8, 64)  # 64 KiB a layer of 4 blocks: messages of several layers
    src, dst = _cache(3, torch.bfloat16, shape), torch.zeros(shape, dtype=torch.bfloat16)
    src_blocks = [5, 2, 9, 3]
    final = src.clone()
    src.zero_()  # nothing computed yet
    staged = kt.StagedKV(src, src_blocks, deferred=True)
    per = staged.per_message
    assert 1 < per < shape[0] and not staged.ready(0) and not staged.source_free()
    asm = kt.LayerAssembler(dst, [8, 0, 1, 6])
    for layer in range(shape[0]):  # the forward writes layer after layer; the sender stages behind it
        src[layer] = final[layer]
        staged.stage_through(layer)
        assert len(staged._futures) == (layer + 1) // per + (layer == shape[0] - 1 and shape[0] % per != 0)
    for g in range(staged.num_messages):
        frame, crcs, _ = staged.result(g)
        asm.add(KVLayers(request_id="r", first=g * per, nbytes=staged.layer_nbytes, checksums=crcs), [frame])
    wait(asm.futures)
    staged.wait_source()
    assert staged.source_free() and asm.complete and asm.error() is None
    assert torch.equal(_blocks(dst, [8, 0, 1, 6]), _blocks(final, src_blocks))


def test_layers_per_message_targets_a_few_megabytes():
    assert kt.layers_per_message(32, 32 << 10) == 32  # 1 MiB in all: one message
    assert kt.layers_per_message(32, 8 << 20) == 1  # 2k tokens of an 8B model: a message a layer
    assert kt.layers_per_message(32, 1 << 20) == 4


def test_waker_wakes_a_poller():
    import zmq

    waker = Waker()
    poller = zmq.Poller()
    poller.register(waker.fd, zmq.POLLIN)
    assert not poller.poll(0)
    waker.wake()
    waker.wake()
    assert poller.poll(0)
    waker.drain()
    assert not poller.poll(0)
    waker.close()


# -- kv_ipc, CPU side -----------------------------------------------------------------------------------
def test_block_runs_and_copy_blocks_match_indexing():
    assert block_runs([4, 5, 6, 9], [0, 1, 2, 3]) == [(4, 0, 3), (9, 3, 1)]
    # with a limit: the runs while there are at most that many, None past it (the plan copies by id then)
    assert block_runs([4, 5, 6, 9], [0, 1, 2, 3], limit=2) == [(4, 0, 3), (9, 3, 1)]
    assert block_runs([4, 5, 6, 9, 11], [0, 1, 2, 3, 4], limit=2) is None
    assert block_runs([], [], limit=0) == []
    with pytest.raises(ValueError, match="3 source blocks for 2"):
        block_runs([1, 2, 3], [1, 2])
    src = _cache(3, shape=(3, 2, 40, 4, 2, 8))
    for src_ids, dst_ids in [([4, 5, 6, 9], [0, 1, 2, 3]), (list(range(0, 40, 2)), list(range(39, 19, -1)))]:
        dst = torch.zeros_like(src)
        copy_blocks(src, src_ids, dst, dst_ids)  # a few runs: slices; many: the block copy kernel's reference
        assert torch.equal(dst[:, :, dst_ids], src[:, :, src_ids])


def test_copy_blocks_rejects_block_ids_out_of_range_before_copying():
    # the copy kernel trusts its ids: an id past either cache would read or write another's memory
    src, dst = _cache(3, shape=(3, 2, 40, 4, 2, 8)), torch.zeros(3, 2, 20, 4, 2, 8)
    many = list(range(0, 20, 2))
    for src_ids, dst_ids in [(many, many[:-1] + [20]), (many[:-1] + [40], many), (many[:-1] + [-1], many),
                             ([5], [20])]:
        with pytest.raises(ValueError, match="out of range"):
            copy_blocks(src, src_ids, dst, dst_ids)
    assert not dst.any()


def _handle(**over) -> KVIpcHandle:
    base = dict(device_uuid="GPU-x", handle=b"\x01" * 64, storage_size=4 * 96 * 10, storage_offset=0,
                ref_counter=b"/torch_1_2_3", ref_counter_offset=0, event_handle=None, event_sync_required=False,
                tensor_offset=0, shape=[3, 2, 10, 4, 2, 8], stride=[1280, 640, 64, 16, 8, 1], dtype="float32")
    return KVIpcHandle(**{**base, **over})


def test_ipc_handle_travels_as_plain_fields_and_is_validated():
    grant = HandoffGrant("r", accepted=True, block_ids=[1], ipc=_handle(), ttl_s=10.0)
    assert decode(encode(grant), HandoffGrant) == grant
    for bad in (dict(handle=b""), dict(shape=[3, 2, 10]), dict(stride=[0] * 6), dict(storage_offset=-1)):
        with pytest.raises(ValueError):
            decode(encode(HandoffGrant("r", accepted=True, ipc=_handle(**bad))), HandoffGrant)
    raw = encode(HandoffGrant("r", accepted=True, ipc=_handle())).replace(b"\xc4\x40" + b"\x01" * 64,
                                                                           b"\xa2ab")  # bytes -> str
    with pytest.raises(ValueError, match="ipc"):
        decode(raw, HandoffGrant)


def test_ipc_is_never_offered_or_opened_off_cuda():
    exporter = Exporter(torch.zeros(SHAPE), CudaIpc())
    assert exporter.offer("p1", "") is None and exporter.offer("p1", "GPU-x") is None
    with pytest.raises(IpcError, match="not this worker's"):
        check_handle(_handle(), torch.zeros(SHAPE))
