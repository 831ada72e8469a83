"""Handoff endpoints without an engine: a KV cache and its blocks (``detached_kv``) are all a transfer
touches, so the handoff benchmark and tests drive the real sender and receiver with these."""

import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from kvrelay.shared.engine import EngineKV, detached_kv, over_tenant_quota
from kvrelay.shared.handoff.sender import HandoffSender
from kvrelay.shared.handoff.transfer import FirstToken, Transfer
from kvrelay.shared.wire.protocol import Job, WorkerInfo
from kvrelay.shared.wire.sampling_params import SamplingParams


@dataclass
class DetachedCore:
    """The slice of an EngineCore the handoff and the decode role's admission read: its KV, and a running
    batch that stays empty (admitted requests keep their blocks and run nowhere)."""

    kv: EngineKV
    max_model_len: int
    max_num_seqs: int = 1024
    num_running: int = 0
    tenant_kv_quota: float | None = None  # --tenant-kv-quota: only grants count against it (nothing runs)

    def __post_init__(self) -> None:
        self.num_total_blocks = self.kv.num_free_blocks

    def is_running(self, request_id: str) -> bool:
        return False

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    def tenant_kv_blocks(self) -> dict[str, int]:
        return {}

    def over_tenant_kv_quota(self, tenant_blocks: int, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size)
        return over_tenant_quota(self.tenant_kv_quota, tenant_blocks, need, self.num_total_blocks)


def endpoint(kv_cache: torch.Tensor, worker_id: str, model: str, scatter_seed: int | None = None,
             prefix_caching: bool = False):
    """What the handoff reads of a worker (``runtime``): its engine core (a ``DetachedCore``) and its id.
    ``scatter_seed``: hand out blocks in a shuffled order, as the free list of a long-running worker does;
    ``prefix_caching``: its reservations may reuse cached blocks (``detached_kv``)."""
    core = DetachedCore(detached_kv(kv_cache, scatter_seed, prefix_caching),
                        max_model_len=kv_cache.shape[2] * kv_cache.shape[3] + 1)
    return SimpleNamespace(core=core, zmq_addr="", redis=None,
                           config=SimpleNamespace(worker_id=worker_id, model_name=model))


def serves(model: str, core):
    """``core_for`` of an endpoint serving one model: ``core`` for ``model``, None for any other."""
    return lambda name: core if name == model else None


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
    src = runtime.core.kv.reserve(request_id, num_tokens)
    if src is None:
        raise RuntimeError("KV cache too small for the handoff")
    sender.start(synthetic_job(request_id, num_tokens, model), request_id.encode(), FirstToken(2))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for t in sender.poll(timeout_ms=20):
            if t.job.request_id == request_id:
                return t, src
    raise TimeoutError(f"handoff of {request_id} did not end")
