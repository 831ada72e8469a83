"""The handoff's mechanics with a tensor-parallel side (real rank processes over gloo, real ZMQ sockets,
a real HandoffManager and HandoffReceiver in the test's thread): KV moves bit-exact as full-head frames
both ways, and a direct-write transport on offer is not used, because a sharded worker neither asks for
direct writes nor offers its cache to them (its blocks are gathered and scattered between steps). A rank
killed with -9 makes the gather or scatter raise promptly, naming the rank, instead of hanging."""

import os
import signal
import time

import pytest
import torch

from kvrelay.prefill_worker.handoff import State
from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig
from kvrelay.shared.engine.engine_core import EngineCore
from kvrelay.shared.engine.ranks.group import TensorParallelError
from kvrelay.shared.handoff.standalone import endpoint
from kvrelay.shared.wire.sampling_params import SamplingParams
from tests.integration.rank_handoff_harness import BLOCK, MODEL, Link, linked

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PROMPT = list(range(3, 40))  # 37 tokens: 5 blocks, the last partly filled


def _engine(model_dir, hold: bool) -> EngineCore:
    return EngineCore(EngineConfig(ModelConfig(str(model_dir), dtype="float32", max_model_len=128),
                                   cache=CacheConfig(block_size=BLOCK, num_gpu_blocks=64), device="cpu", tensor_parallel_size=2),
                      hold_finished_kv=hold)


def test_tp2_prefill_sends_its_ranks_heads_as_frames(tiny_model_dirs):
    prefill = _engine(tiny_model_dirs["llama"], hold=True)
    decode = endpoint(torch.zeros((2, 2, 64, BLOCK, 2, 16)), "d1", MODEL)  # one rank: both KV heads
    link = linked(decode.core, prefill)
    try:
        prefill.add_request(prefill.make_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=1)))
        while prefill.has_unfinished():
            prefill.step()
        held = prefill.kv.block_ids("r")
        want = prefill.kv.export_blocks(held)
        assert want.shape == (2, 2, len(held), BLOCK, 2, 16) and want.abs().sum() > 0
        t = link.hand_off("r", len(PROMPT))
        assert t.state is State.DONE, t.reason
        assert t.grant.ipc is None and t.transport == "layers" and not t.streamed  # no direct write asked for
        assert torch.equal(decode.core.kv.kv_cache[:, :, decode.core.kv.block_ids("r")], want)
        assert prefill.kv.num_free_blocks == prefill.num_total_blocks  # released once staged
    finally:
        link.close()
        prefill.shutdown()


def test_tp2_decode_takes_frames_into_each_rank_and_offers_no_direct_writes(tiny_model_dirs):
    decode = _engine(tiny_model_dirs["llama"], hold=False)
    kv = torch.randn((2, 2, 64, BLOCK, 2, 16), generator=torch.Generator().manual_seed(5))
    prefill = endpoint(kv, "p1", MODEL, scatter_seed=2)
    link = Link(decode, prefill)
    try:
        src = prefill.core.kv.reserve("r", len(PROMPT))
        t = link.hand_off("r", len(PROMPT))
        assert t.state is State.DONE, t.reason
        assert t.grant.ipc is None and t.transport == "layers"  # the asker shares our process: no offer all the same
        assert "r" in link.admitted
        # read back from every rank: each holds its own head of the blocks that were granted
        assert torch.equal(decode.kv.export_blocks(decode.kv.block_ids("r")), kv[:, :, src])
    finally:
        link.close()
        decode.shutdown()


def _kill_rank(core: EngineCore) -> int:
    (pid,) = core.runner.ranks.pids
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_rank_killed_before_the_handoff_fails_it_promptly_naming_the_rank(tiny_model_dirs, side):
    sharded = _engine(tiny_model_dirs["llama"], hold=side == "prefill")
    other = endpoint(torch.zeros((2, 2, 64, BLOCK, 2, 16)), "x", MODEL)
    link = linked(other.core, sharded) if side == "prefill" else Link(sharded, other)
    try:
        if side == "prefill":
            sharded.add_request(sharded.make_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=1)))
            while sharded.has_unfinished():
                sharded.step()
        else:
            other.core.kv.reserve("r", len(PROMPT))
        pid = _kill_rank(sharded)
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match=f"rank 1 of 2 \\(pid {pid}\\) was killed by signal 9"):
            link.hand_off("r", len(PROMPT))
        assert time.monotonic() - started < 60
    finally:
        link.close()
        sharded.shutdown()
