"""The KV handoff with an fp8 (float8_e4m3fn) cache, over real ZMQ sockets (tests/integration/
handoff_harness.py): fp8 blocks move as their bytes, bit for bit, through host-staged frames and through
direct writes; a decode worker whose cache stores another dtype refuses the ask, with a reason that
says so, before any byte moves (its bytes would be misread as bf16/fp32 values)."""

import pytest
import torch

from kvrelay.prefill_worker.handoff import State
from kvrelay.shared.engine import detached_kv
from kvrelay.shared.handoff.fake import in_process
from kvrelay.shared.handoff.frames import Frames
from tests.integration.handoff_harness import BLOCK, hand_off_tiny, wait_for

FP8 = torch.float8_e4m3fn


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
    manager = make(side.addr)
    free = side.rt.core.kv.num_free_blocks
    t, _ = hand_off_tiny(manager, rt, "r", 3 * BLOCK)
    assert t.state is State.FAILED
    names = {FP8: "float8_e4m3fn", torch.bfloat16: "bfloat16", torch.float32: "float32"}
    assert (f"KV cache dtype mismatch: the prefill worker's KV is {names[prefill_dtype]}, this decode worker's "
            f"is {names[decode_dtype]}; give both the same --kv-cache-dtype") in t.reason, t.reason
    assert side.receiver.bytes_received == 0 and "r" not in side.admitted
    assert side.rt.core.kv.num_free_blocks == free  # nothing reserved for it on the decode side
