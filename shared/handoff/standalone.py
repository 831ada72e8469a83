"""Handoff endpoints without an engine: a KV cache and a block manager are all a transfer touches, so
the handoff benchmark and tests drive the real sender and receiver with these."""

import time
from collections import OrderedDict
from types import SimpleNamespace

import torch

from kvrelay.shared.engine.block_manager import BlockManager
from kvrelay.shared.handoff.sender import HandoffSender
from kvrelay.shared.handoff.transfer import FirstToken, Transfer
from kvrelay.shared.wire.protocol import Job, WorkerInfo
from kvrelay.shared.wire.sampling_params import SamplingParams


class HeldBlocks:
    """The slice of the scheduler a handoff touches: running requests (none) and held prefill KV."""

    def __init__(self, block_manager: BlockManager):
        self.block_manager = block_manager
        self.num_running = 0
        self.running: list = []

    def release_held(self, request_id: str) -> None:
        self.block_manager.free(request_id)


def endpoint(kv_cache: torch.Tensor, worker_id: str, model: str, scatter_seed: int | None = None):
    """What the handoff reads of a worker (``runtime``): its engine core's KV cache, block manager and
    scheduler, and its id. ``scatter_seed``: hand out blocks in a shuffled order, as the free list of a
    long-running worker does."""
    num_blocks, block_size = kv_cache.shape[2], kv_cache.shape[3]
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    if scatter_seed is not None:
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(scatter_seed)).tolist()
        bm.free_queue = OrderedDict.fromkeys(order)
    core = SimpleNamespace(block_manager=bm, scheduler=HeldBlocks(bm), max_model_len=num_blocks * block_size + 1,
                           runner=SimpleNamespace(kv_cache=kv_cache, block_size=block_size),
                           config=SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=1024)))
    return SimpleNamespace(core=core, zmq_addr="", redis=None,
                           config=SimpleNamespace(worker_id=worker_id, model_name=model))


def decode_info(addr: str, model: str, worker_id: str = "d1") -> WorkerInfo:
    """A decode worker's registration, as a sender's ``workers()`` lists it."""
    return WorkerInfo(worker_id=worker_id, role="decode", models=[model], zmq_addr=addr, free_blocks=1,
                      total_blocks=1, running=0, waiting=0, pid=0, host="", started=0.0, heartbeat=0.0)


def synthetic_job(request_id: str, num_tokens: int, model: str) -> Job:
    return Job(request_id=request_id, model=model, prompt_token_ids=[1] * num_tokens, sampling=SamplingParams(), tenant="bench",
               priority=0, reply_addr="", deadline=0.0, arrival=0.0)


def hand_off(sender: HandoffSender, runtime, request_id: str, num_tokens: int, model: str,
             timeout_s: float = 60.0) -> tuple[Transfer, list[int]]:
    """Hold prefill blocks for a prompt of ``num_tokens`` (as a finished prefill does), hand them off and
    wait for the end: the ended transfer and the source blocks."""
    src = runtime.core.block_manager.allocate_for_tokens(request_id, num_tokens)
    if src is None:
        raise RuntimeError("KV cache too small for the handoff")
    sender.start(synthetic_job(request_id, num_tokens, model), request_id.encode(), FirstToken(2))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for t in sender.poll(timeout_ms=20):
            if t.job.request_id == request_id:
                return t, src
    raise TimeoutError(f"handoff of {request_id} did not end")
