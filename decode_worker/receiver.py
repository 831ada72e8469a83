"""The decode role's side of the KV handoff: which handed-off requests it takes. Blocks are reserved
before a grant goes out (SGLang style: decode pre-allocates, prefill writes), and a request that
cannot run here is refused up front rather than trusted; receiving, checking and acking the KV are
shared/handoff/receiver.py's. A tenant at its --tenant-kv-quota here waits for its grant (tenant_quota.py)."""

from collections.abc import Callable

from kvrelay.decode_worker.tenant_quota import TenantQuota
from kvrelay.shared.engine import EngineCore
from kvrelay.shared.handoff.base import Transport
from kvrelay.shared.handoff.blocks import DTYPE_NAMES
from kvrelay.shared.handoff.grants import Busy, Reservation
from kvrelay.shared.handoff.receiver import KVInbox
from kvrelay.shared.wire.handoff import HandoffRequest
from kvrelay.shared.wire.version import version_refusal


class HandoffReceiver(KVInbox):
    def __init__(self, sock, core_for: Callable[[str], EngineCore | None], grant_ttl_s: float,
                 transports: list[Transport] | None = None, max_per_peer: int | None = None,
                 asker_alive: Callable[[str], bool] | None = None, bulk=None):
        """``core_for(model)``: the engine serving that model instance here, or None; a worker hosting
        several models routes each request by its model. ``max_per_peer``: handoffs of one model one
        asker may hold granted or arriving (default: half the model's max_num_seqs), so a peer that asks
        and never sends cannot take every seat. ``bulk``: (plain socket, its address) where MAC'd frames
        come (shared/handoff/receiver.py)."""
        super().__init__(sock, core_for, grant_ttl_s, transports, asker_alive, bulk)
        self.max_per_peer = max_per_peer
        self.accepting = True  # False while the worker drains: no new grants, granted KV still taken
        self.quota = TenantQuota()
        self.on_granted: Callable[[str], None] = lambda reply_addr: None  # the worker opens that gateway's connection

    def poll(self, timeout_ms: int, admit) -> int:
        self.quota.new_round()
        return super().poll(timeout_ms, admit)

    def _answer_held(self) -> None:
        if self.held:  # KV that landed since the round began is its engine's now: count its tenants' blocks again
            self.quota.new_round()
        super()._answer_held()

    def reserve(self, req: HandoffRequest, pending: int, from_peer: int) -> Reservation | str:
        answer = self._reserve(req, pending, from_peer)
        if isinstance(answer, str) and not isinstance(answer, Busy):
            self.quota.leave(req)  # refused for good: it will not ask here again
        elif isinstance(answer, Reservation) and req.reply_addr:
            self.on_granted(req.reply_addr)
        return answer

    def _reserve(self, req: HandoffRequest, pending: int, from_peer: int) -> Reservation | str:
        if not self.accepting:
            return "decode worker is draining"
        if refusal := version_refusal(req.protocol, "the prefill worker"):
            return refusal
        core = self.core_for(req.model)
        if core is None:
            return f"model {req.model!r} is not served here"
        if req.block_size != core.kv.block_size:
            return f"block size {req.block_size} != {core.kv.block_size}"
        mine = DTYPE_NAMES[core.kv.kv_cache.dtype]
        if req.kv_dtype and req.kv_dtype != mine:
            return (f"KV cache dtype mismatch: the prefill worker's KV is {req.kv_dtype}, this decode worker's "
                    f"is {mine}; give both the same --kv-cache-dtype")
        if req.kv_scales and req.kv_scales != core.kv.scales_digest:
            return (f"KV cache scales mismatch: the prefill worker's fp8 KV scales (digest {req.kv_scales}) are not "
                    f"this decode worker's ({core.kv.scales_digest or 'none'}); load the same checkpoint, with the same "
                    "--calculate-kv-scales, on both")
        if core.is_running(req.request_id):
            return "duplicate request id"  # a reclaimed job must never stream twice
        if req.num_tokens >= core.max_model_len:
            return f"{req.num_tokens} tokens exceed max_model_len {core.max_model_len}"
        # before the seats: a tenant's asks keep their order in its line while the batch is full too
        if refusal := self.quota.check(core, req, self.tenant_blocks):
            return refusal
        cap = self.max_per_peer or max(1, core.max_num_seqs // 2)
        if from_peer >= cap:  # refused like a full batch: the asker parks and asks again
            return Busy(f"this prefill worker already holds {from_peer} handoffs here (--max-handoffs-per-peer)")
        if core.num_running + pending >= core.max_num_seqs:
            return Busy("running batch is full (max_num_seqs)")
        # the prompt's leading blocks this worker holds already (an n > 1 sibling's, an earlier turn's, a shared
        # system prompt's) are reused; only the rest is granted and sent
        reserved = core.kv.reserve_prefix(req.request_id, req.num_tokens, req.block_hashes)
        if reserved is None:
            return Busy("no free KV blocks")
        blocks, cached = reserved
        self.quota.granted(core, req, blocks, self.tenant_blocks)
        return Reservation(fresh=blocks[cached:], reused=blocks[:cached])
