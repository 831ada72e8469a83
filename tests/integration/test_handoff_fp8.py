"""The KV handoff with an fp8 (float8_e4m3fn) cache, over real ZMQ sockets (tests/integration/
handoff_harness.py): fp8 blocks move as their bytes, bit for bit, through host-staged frames and through
direct writes; a decode worker whose cache stores another dtype, or fp8 under other per-layer scales (another
checkpoint's, shared/engine/kv_scales.py), refuses the ask, with a reason that says so, before any byte moves
(its bytes would be misread as bf16/fp32 values, or as other fp8 values)."""

import pytest
import torch

from kvrelay.prefill_worker.handoff import State
from kvrelay.shared.engine import detached_kv
from kvrelay.shared.engine.kv_scales import scales_digest
from kvrelay.shared.handoff.fake import in_process
from kvrelay.shared.handoff.frames import Frames
from tests.integration.handoff_harness import BLOCK, SHAPE, hand_off_tiny, wait_for

FP8 = torch.float8_e4m3fn
# A refused transfer asks again until its handoff budget ends (a decode worker that takes it may register), and
# fails then with the refusal's reason, which is what these tests check: a short budget, still many times the
# decode side's answer (it polls every 20 ms).
REFUSED_WITHIN_S = 1.5


def _fp8_prefill(rt) -> None:
    # random values stored as fp8 (every byte pattern a real cache could hold, NaN aside)
    rt.core.kv = detached_kv((rt.core.kv.kv_cache * 50).to(FP8), scatter_seed=3)


@pytest.mark.parametrize("transport", ["layers", "ipc"])
def test_fp8_blocks_land_bit_exact(prefill, decode_side, transport):
    rt, make = prefill
    _fp8_prefill(rt)
    transports = [in_process(), Frames()] if transport == "ipc" else None
    side = decode_side(dtype=FP8, transports=transports)
    manager = make(side.addr, transports=transports)
    total = rt.core.kv.num_free_blocks
    for rid, num_tokens in [("small", 5), ("big", 40 * BLOCK - 3)]:
        t, src = hand_off_tiny(manager, rt, rid, num_tokens)
        assert t.state is State.DONE and t.transport == transport, t.reason
        wait_for(lambda rid=rid: rid in side.admitted, "admission")
        got = side.rt.core.kv.kv_cache[:, :, side.blocks(rid)]
        assert got.dtype == FP8
        assert torch.equal(got.view(torch.uint8), rt.core.kv.kv_cache[:, :, src].view(torch.uint8))
        assert side.admitted[rid].dtype == "float8_e4m3fn"
    assert rt.core.kv.num_free_blocks == total


@pytest.mark.parametrize("prefill_dtype,decode_dtype", [(FP8, torch.bfloat16), (torch.float32, FP8)])
def test_a_kv_dtype_mismatch_is_refused_before_any_byte_moves(prefill, decode_side, prefill_dtype, decode_dtype):
    rt, make = prefill
    if prefill_dtype == FP8:
        _fp8_prefill(rt)
    side = decode_side(dtype=decode_dtype)
    manager = make(side.addr, timeout_s=REFUSED_WITHIN_S)
    free = side.rt.core.kv.num_free_blocks
    t, _ = hand_off_tiny(manager, rt, "r", 3 * BLOCK)
    assert t.state is State.FAILED
    names = {FP8: "float8_e4m3fn", torch.bfloat16: "bfloat16", torch.float32: "float32"}
    assert (f"KV cache dtype mismatch: the prefill worker's KV is {names[prefill_dtype]}, this decode worker's "
            f"is {names[decode_dtype]}; give both the same --kv-cache-dtype") in t.reason, t.reason
    assert side.receiver.bytes_received == 0 and "r" not in side.admitted
    assert side.rt.core.kv.num_free_blocks == free  # nothing reserved for it on the decode side


@pytest.mark.parametrize("decode_scales", ["same", "unit", "other"])
def test_fp8_kv_under_other_scales_is_refused_before_any_byte_moves(prefill, decode_side, decode_scales):
    rt, make = prefill
    _fp8_prefill(rt)
    layers = SHAPE[0]
    calibrated = [[0.37, 1.9]] * layers
    rt.core.kv.scales_digest = scales_digest(calibrated, layers)
    side = decode_side(dtype=FP8)
    other = {"same": calibrated, "unit": [], "other": [[0.37, 1.9]] * (layers - 1) + [[0.37, 1.8]]}[decode_scales]
    side.rt.core.kv.scales_digest = scales_digest(other, layers)
    manager = make(side.addr) if decode_scales == "same" else make(side.addr, timeout_s=REFUSED_WITHIN_S)
    free = side.rt.core.kv.num_free_blocks
    t, _ = hand_off_tiny(manager, rt, "r", 3 * BLOCK)
    if decode_scales == "same":
        assert t.state is State.DONE, t.reason
        return
    assert t.state is State.FAILED
    assert (f"KV cache scales mismatch: the prefill worker's fp8 KV scales (digest {rt.core.kv.scales_digest}) are "
            f"not this decode worker's ({side.rt.core.kv.scales_digest}); load the same checkpoint, with the same "
            "--calculate-kv-scales, on both"
            ) in t.reason, t.reason
    assert side.receiver.bytes_received == 0 and "r" not in side.admitted
    assert side.rt.core.kv.num_free_blocks == free
