"""The same-GPU CUDA IPC handoff (``pytest -m gpu`` on a CUDA machine): a real prefill process writes
its blocks straight into this process's KV cache, and when IPC is not possible the host-staged
layer frames carry the same bytes. Both sides use the real HandoffManager / HandoffReceiver."""

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq

from kvrelay.prefill_worker.handoff import HandoffManager, State
from kvrelay.shared.handoff.blocks import copy_blocks
from kvrelay.shared.handoff.cuda_ipc import CudaIpc, device_uuid, export_handle
from kvrelay.shared.handoff.direct import DeviceCopy, Exporter, IpcError, Peers
from kvrelay.shared.handoff.frames import Frames, StagedKV
from kvrelay.shared.handoff.standalone import decode_info, endpoint, hand_off
from tests.integration.handoff_harness import DecodeSide
from tests.zmq_secret import CURVE

pytestmark = pytest.mark.gpu
MODEL = "tiny"
SHAPE = (8, 2, 96, 16, 4, 64)  # [L, 2, N, bs, Hkv, D]
BLOCK = SHAPE[3]
CASES = [("short", 5), ("one-block", BLOCK), ("long", 40 * BLOCK - 3)]


def _source_cache() -> torch.Tensor:
    # generated on the CPU from a seed, so the other process and this one agree on every byte
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).cuda()


def _hand_off(manager: HandoffManager, rt, rid: str, num_tokens: int):
    return hand_off(manager, rt, rid, num_tokens, MODEL, timeout_s=60)


def _prefill_process(addr: str) -> None:
    """The other process: a prefill worker's handoff half, handing CASES off to ``addr``."""
    kv = _source_cache()
    rt = endpoint(kv, "p-gpu", MODEL, scatter_seed=3)
    manager = HandoffManager(zmq.Context(), rt, 10.0, workers=lambda: [decode_info(addr, MODEL)], curve=CURVE)
    for rid, num_tokens in CASES:
        t, src = _hand_off(manager, rt, rid, num_tokens)
        print(json.dumps(dict(rid=rid, state=t.state.value, transport=t.transport, src=src, reason=t.reason)),
              flush=True)
    manager.close()


@pytest.fixture()
def decode_side():
    side = DecodeSide(torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda"))
    yield side
    side.close()


def test_gpu_identity_is_known():
    assert device_uuid("cuda") and device_uuid("cuda") == device_uuid(torch.device("cuda", 0))
    assert device_uuid("cpu") == ""


def test_ipc_copy_between_two_processes_equals_the_source_blocks(decode_side):
    # PYTHONSAFEPATH (tests/conftest.py) keeps the working folder off the child's path, so it is named here
    root = str(Path(__file__).resolve().parents[2])
    code = (f"import sys; sys.path.append({root!r}); "
            "from tests.gpu.test_kv_ipc import _prefill_process; _prefill_process(sys.argv[1])")
    proc = subprocess.run([sys.executable, "-c", code, decode_side.addr], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["rid"] for r in results] == [rid for rid, _ in CASES]
    src_kv = _source_cache()
    for r in results:
        assert r["state"] == "done" and r["transport"] == "ipc", r
        dst = decode_side.blocks(r["rid"])
        assert torch.equal(decode_side.rt.core.kv.kv_cache[:, :, dst], src_kv[:, :, r["src"]])
    untouched = sorted(set(range(SHAPE[2])) - {b for r in results for b in decode_side.blocks(r["rid"])})
    assert not decode_side.rt.core.kv.kv_cache[:, :, untouched].any()


def _in_process_prefill(addr: str, transports=None):
    kv = _source_cache()
    rt = endpoint(kv, "p-local", MODEL, scatter_seed=3)
    return rt, HandoffManager(zmq.Context.instance(), rt, 10.0, workers=lambda: [decode_info(addr, MODEL)],
                              transports=transports, curve=CURVE)


def _check_landed(side: DecodeSide, rt, rid: str, src: list[int]) -> None:
    deadline = time.monotonic() + 30
    while rid not in side.admitted:
        assert time.monotonic() < deadline, "never admitted"
        time.sleep(0.01)
    dst = side.blocks(rid)
    assert torch.equal(side.rt.core.kv.kv_cache[:, :, dst], rt.core.kv.kv_cache[:, :, src])


def test_frames_carry_gpu_caches_when_ipc_is_not_asked_for(decode_side):
    rt, manager = _in_process_prefill(decode_side.addr, transports=[Frames()])  # as from another GPU or host
    for rid, num_tokens in CASES:
        t, src = _hand_off(manager, rt, rid, num_tokens)
        assert t.state is State.DONE and t.transport == "layers", t.reason
        _check_landed(decode_side, rt, rid, src)
    manager.close()


def test_frames_land_while_host_syncs_raise(decode_side):
    # a model load's capture check turns torch's sync-debug mode to "error" for the whole process
    # (cuda_graphs.syncs_raise) while the handoff's threads run on: a frame copied up, or a transfer finished,
    # by blocking the host would then raise and fail the transfer
    rt, manager = _in_process_prefill(decode_side.addr, transports=[Frames()])
    ended = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for rid, num_tokens in CASES:
            ended.append((rid, *_hand_off(manager, rt, rid, num_tokens)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for rid, t, src in ended:
        assert t.state is State.DONE and t.transport == "layers", t.reason
        _check_landed(decode_side, rt, rid, src)
    manager.close()


def test_falls_back_to_frames_when_the_ipc_handle_cannot_be_mapped(decode_side):
    rt, manager = _in_process_prefill(decode_side.addr)
    direct = decode_side.receiver.transports[0]
    exporter = direct.exporters[MODEL] = Exporter(decode_side.rt.core.kv.kv_cache, CudaIpc())
    real_offer = exporter.offer

    def broken_offer(requester, asker_uuid):
        h = real_offer(requester, asker_uuid)
        assert h is not None, "same GPU: the decode side must offer IPC"
        return dataclasses.replace(h, handle=bytes(len(h.handle)))  # a handle the driver refuses

    exporter.offer = broken_offer
    for rid, num_tokens in CASES:
        t, src = _hand_off(manager, rt, rid, num_tokens)
        assert t.state is State.DONE and t.transport == "layers", t.reason
        _check_landed(decode_side, rt, rid, src)
    manager.close()


def test_opener_refuses_a_cache_of_another_layout():
    mine = torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda")
    other = torch.zeros(SHAPE[:4] + (8, 64), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(IpcError, match="shape"):
        Peers(mine, CudaIpc()).open("d1", export_handle(other))
    with pytest.raises(IpcError, match="dtype"):
        Peers(mine, CudaIpc()).open("d1", export_handle(other.float()))


@pytest.mark.parametrize("scattered", [False, True])
def test_device_copy_paths_match_indexing(scattered):
    src = _source_cache()
    dst = torch.zeros_like(src)
    src_ids = list(range(0, 80, 2)) if scattered else list(range(10, 50))
    dst_ids = list(range(95, 55, -1)) if scattered else list(range(40))
    copy_blocks(src, src_ids, dst, dst_ids)
    torch.cuda.synchronize()
    assert torch.equal(dst[:, :, dst_ids], src[:, :, src_ids])


@pytest.mark.parametrize("sender", ["ipc-copy", "staged"])
def test_layer_by_layer_senders_follow_the_compute_stream(sender):
    """Deferred (streamed) senders on CUDA: each layer range is copied / staged behind the compute
    stream as of its ``stage_through``, so a layer written by kernels still queued when it is called
    (the forward runs ahead of the GPU) arrives in full."""
    final = _source_cache()
    src = torch.zeros_like(final)
    blocks, dst_blocks = list(range(3, 40, 2)), list(range(60, 79))
    if sender == "ipc-copy":
        dst = torch.zeros_like(final)
        s = DeviceCopy(src, blocks, dst, dst_blocks, deferred=True)
    else:
        s = StagedKV(src, blocks, deferred=True)
    for layer in range(SHAPE[0]):
        torch.cuda._sleep(2_000_000)  # the compute stream is busy when the copy is queued behind it
        src[layer].copy_(final[layer])
        s.stage_through(layer)
    if sender == "ipc-copy":
        s.wait()
        assert s.done()
        assert torch.equal(dst[:, :, dst_blocks], final[:, :, blocks])
    else:
        got = torch.cat([torch.frombuffer(bytearray(s.result(g)[0]), dtype=torch.bfloat16)
                         for g in range(s.num_messages)])
        assert torch.equal(got.view_as(final[:, :, blocks].cpu()), final[:, :, blocks].cpu())
