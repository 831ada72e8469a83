"""Host-staged frames on the decode side's plain bulk socket, each MAC'd under its grant's own key (what a CURVE
deployment does unless --encrypt-kv-frames), over real ZMQ sockets: they land as the CRC'd frames on the CURVE
socket do, and a frame that is not its grant's (a wrong key, another grant's, another layer's, altered, or no MAC
at all) is refused before a byte lands, while the worker goes on serving."""

import dataclasses
import os
import subprocess

import pytest
import torch
import zmq

from kvrelay.prefill_worker.handoff import State
from kvrelay.shared.config.handover import module_argv
from kvrelay.shared.handoff.frames import StagedKV
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.handoff import HandoffAck, HandoffCancel, HandoffGrant, KVLayers
from tests.integration.handoff_harness import BLOCK, hand_off_tiny, wait_for
from tests.integration.test_handoff import _ask, _dealer, _header

NUM_TOKENS = 30 * BLOCK  # 30 blocks: 4 layers a message, 2 messages


def test_mac_frames_land_bit_exact_as_crc_frames_do(prefill, decode_side):
    rt, make = prefill
    crc_side, mac_side = decode_side(), decode_side(bulk=True)
    on_bulk, seen = mac_side.receiver._on_bulk, []
    mac_side.receiver._on_bulk = lambda frames: (seen.append(decode(frames[1].bytes, KVLayers)), on_bulk(frames))
    landed = {}
    for side in (crc_side, mac_side):
        t, src = hand_off_tiny(make(side.addr), rt, "same", NUM_TOKENS)
        assert t.state is State.DONE and t.transport == "layers", t.reason
        wait_for(lambda side=side: "same" in side.admitted, "admission")
        landed[side] = side.rt.core.kv.kv_cache[:, :, side.blocks("same")]
        assert torch.equal(landed[side], rt.core.kv.kv_cache[:, :, src])
        assert side.admitted["same"].first_token_id == 2
    assert torch.equal(landed[crc_side], landed[mac_side])
    # every frame came on the bulk socket, MAC'd and without CRCs
    assert [m.first for m in seen] == [0, 4] and all(m.mac and not m.checksums for m in seen)


def _frames(kv: torch.Tensor, rid: str, grant: HandoffGrant, key: bytes | None = None) -> list[list]:
    staged = StagedKV(kv, list(range(30)), epoch=grant.epoch, key=grant.frames_key if key is None else key)
    return [staged.message(rid, g) for g in range(staged.num_messages)]


def _plain(addr: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)  # anyone who reaches the bulk socket: no CURVE there
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    return sock


def _retag(parts: list, **fields) -> list:
    return [encode(dataclasses.replace(decode(parts[0], KVLayers), **fields)), parts[1]]


def _tampered(parts: list) -> list:
    frame = bytearray(parts[1])
    frame[100] ^= 0x01
    return [parts[0], bytes(frame)]


# each: (what a peer holding grant ``a`` for "a" and grant ``b`` for "b" sends on the bulk socket for "b")
CASES = {
    "a wrong key": lambda kv, a, b: _frames(kv, "b", b, key=os.urandom(32)),
    "another grant's frames": lambda kv, a, b: [_retag(p, request_id="b", epoch=b.epoch) for p in _frames(kv, "a", a)],
    "a frame again at another layer": lambda kv, a, b: (f := _frames(kv, "b", b))[:1] + [_retag(f[0], first=4)],
    "a flipped bit": lambda kv, a, b: [_tampered(p) for p in _frames(kv, "b", b)],
}


@pytest.mark.parametrize("case", CASES)
def test_a_frame_not_made_with_its_grants_key_is_refused_before_a_byte_lands(prefill, decode_side, case):
    rt, make = prefill
    side = decode_side(bulk=True)
    kv, total = rt.core.kv.kv_cache, side.rt.core.kv.num_free_blocks
    control = _dealer(side.addr)
    a, b = _ask(control, "a", NUM_TOKENS), _ask(control, "b", NUM_TOKENS)
    assert b.frames_addr == side.bulk_addr and len(b.frames_key) == 32 and a.frames_key != b.frames_key
    bulk = _plain(b.frames_addr)
    for parts in CASES[case](kv, a, b):
        bulk.send_multipart(parts)
    control.send(encode(_header(kv, "b", b, NUM_TOKENS)))
    ack = decode(control.recv(), HandoffAck)
    assert not ack.ok and "MAC mismatch" in ack.reason, ack.reason
    landed = side.rt.core.kv.kv_cache[:, :, b.block_ids]
    first_bad = 4 if case == "a frame again at another layer" else 0  # its first frame was the grant's own
    assert not side.admitted and not landed[first_bad:].any()  # nothing refused landed
    control.send(encode(HandoffCancel(request_id="a", epoch=a.epoch)))
    wait_for(lambda: side.rt.core.kv.num_free_blocks == total, "the refused transfers' blocks")
    t, src = hand_off_tiny(make(side.addr), rt, "good", NUM_TOKENS)  # the worker lives and takes the next
    assert t.state is State.DONE, t.reason
    wait_for(lambda: "good" in side.admitted, "admission")
    assert torch.equal(side.rt.core.kv.kv_cache[:, :, side.blocks("good")], kv[:, :, src])
    control.close()
    bulk.close()


def test_crc_frames_on_the_bulk_socket_are_dropped_unopened(prefill, decode_side):
    """Without a MAC a frame on the plain socket could be anyone's: it opens nothing, and the grant is still
    there for its holder's real frames."""
    rt, make = prefill
    side = decode_side(bulk=True)
    kv = rt.core.kv.kv_cache
    control = _dealer(side.addr)
    grant = _ask(control, "r", NUM_TOKENS)
    bulk = _plain(grant.frames_addr)
    for parts in _frames(kv, "r", grant, key=b""):  # CRC'd, as over the CURVE socket
        bulk.send_multipart(parts)
    bulk.send_multipart([b"not a message"])
    wait_for(lambda: side.receiver.refused_bulk == 3, "both frames and the junk dropped")
    assert "r" in side.receiver.grants and "r" not in side.receiver.incoming
    for parts in _frames(kv, "r", grant):  # the grant's holder, with its key
        bulk.send_multipart(parts)
    control.send(encode(_header(kv, "r", grant, NUM_TOKENS)))
    ack = decode(control.recv(), HandoffAck)
    assert ack.ok, ack.reason
    assert torch.equal(side.rt.core.kv.kv_cache[:, :, grant.block_ids], kv[:, :, list(range(30))])
    control.close()
    bulk.close()


def test_the_benchmark_prints_macd_encrypted_and_insecure_frames_side_by_side():
    """``kvrelay bench handoff --sections cpu`` at a toy size, as its own process: one call, each of the three ways
    the frames go, the MAC'd ones over 1 and over 2 bulk sockets (the benchmark raises unless each transfer ended
    DONE over frames)."""
    proc = subprocess.run([*module_argv("kvrelay.bench.handoff"), "--sections", "cpu", "--transports",
                           "tcp", "--tokens", "8", "--repeats", "1", "--frame-streams", "1,2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.split("how the frames are protected and spread")[1].splitlines()
    assert "| KV size | tokens | MAC'd frames, 1 plain bulk socket GB/s | MAC'd frames, 2 plain bulk sockets GB/s | " \
           "ratio | CURVE-encrypted frames GB/s | ratio | --insecure-zmq frames GB/s | ratio |" in out
    assert [line.count("|") for line in out if line.startswith("| 1 MiB | 8 |")] == [10]
    # each way's CPU seconds per GB moved, each side: numbers, and the decode side's its own process's
    cpu = proc.stdout.split("CPU seconds per GB moved")[1].split("\n\n")[0].splitlines()
    assert "| KV size | frames | GB/s | prefill CPU s/GB | decode CPU s/GB |" in cpu
    rows = [line.split(" | ") for line in cpu if line.startswith("| 1 MiB |")]
    assert [r[1] for r in rows] == ["MAC'd frames, 1 plain bulk socket", "MAC'd frames, 2 plain bulk sockets",
                                    "CURVE-encrypted frames", "--insecure-zmq frames"]
    assert all(float(r[3]) > 0 and float(r[4].rstrip(" |")) >= 0 for r in rows), rows
