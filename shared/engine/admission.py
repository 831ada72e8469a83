"""What enters the scheduler's running set and what leaves it for lack of blocks: admission of waiting
requests (prefix-cache reuse, swap-in, tenant quotas) and preemption. A mixin of Scheduler (scheduler.py),
which holds the queues declared below and ends requests (``_end``).

When a running request cannot get blocks, the lowest-priority running request (the list's tail) is
preempted: swapped to host memory when there is room, otherwise dropped and recomputed later. The
scheduler only moves block ids; the runner executes the copies in ``SchedulerOutput`` and the compute.

Tenants (``SchedulerConfig.tenant_fairness``, on by default): admission picks between tenants by the
tokens each has been served (``fair_queue.py``), so one tenant's flood cannot starve another; within a
tenant the policy's order holds. With ``tenant_kv_quota`` a tenant's request is admitted only if the
blocks of its whole known sequence fit under that share of the pool together with what the tenant
holds; otherwise it waits, and other tenants are admitted past it. Running requests still grow by
their decode tokens, and a tenant holding no blocks can always start one request, so a quota never
makes a request unservable; but when blocks run out, a tenant holding more than its share is preempted
before any other. A request whose prompt another running request is computing right now waits
too, and starts from that request's cached blocks a step later (prompt_sharing.py: ``n > 1`` siblings). A
decode worker applies the same rule (``over_tenant_quota``) to the requests handed to it
(decode_worker/tenant_quota.py), which enter the running set without passing admission.
"""

import bisect
from collections.abc import Iterable

from kvrelay.shared.config.engine import SchedulerConfig
from kvrelay.shared.engine.block_manager import BlockManager, cdiv
from kvrelay.shared.engine.fair_queue import FairWaitingQueue
from kvrelay.shared.engine.prompt_sharing import SharedPrompts
from kvrelay.shared.engine.request import Request, RequestStatus
from kvrelay.shared.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from kvrelay.shared.engine.swap import HostBlockPool
from kvrelay.shared.engine.token_budget import StepBudget

_OVER_QUOTA = -1  # _admit: the request's tenant is at its KV quota; other tenants may still be admitted


def over_tenant_quota(quota: float | None, tenant_blocks: int, need: int, num_blocks: int) -> bool:
    """Whether a request needing ``need`` more blocks would take a tenant holding ``tenant_blocks`` of a pool of
    ``num_blocks`` past the share ``quota`` (--tenant-kv-quota). A tenant holding none may always start one."""
    if quota is None or tenant_blocks == 0:
        return False
    return tenant_blocks + need > quota * num_blocks


class Admission:
    config: SchedulerConfig
    block_manager: BlockManager
    host_pool: HostBlockPool
    max_model_len: int
    enable_prefix_caching: bool
    _running: list[Request]
    _waiting: FairWaitingQueue
    _held: dict[str, Request]
    _busy: frozenset[str]
    shared_prompts: SharedPrompts

    def _order(self, req: Request) -> tuple[int, float]:
        return (req.priority, req.arrival_time)

    def _insert_running(self, req: Request) -> None:
        if self.config.policy == "priority":
            bisect.insort(self._running, req, key=self._order)
        else:
            self._running.append(req)

    def _never_fits(self, req: Request, capacity: int | None = None, pending: int = 0) -> str | None:
        """``capacity``: the block manager's, when the caller already asked (it costs a pool lookup);
        ``pending``: tokens sampled but not yet read (async scheduling) to count in."""
        num_tokens = req.num_tokens + pending
        if num_tokens > self.max_model_len:
            return f"request has {num_tokens} tokens, beyond max_model_len {self.max_model_len}"
        need = cdiv(num_tokens, self.block_manager.block_size)
        capacity = self.block_manager.capacity if capacity is None else capacity
        if need > capacity:
            return f"request needs {need} KV blocks but the whole pool has {capacity}"
        return None

    # ---- admission ----

    def _admit_waiting(self, out: SchedulerOutput, budget: StepBudget, room: int) -> None:
        """Admit waiting requests into the running set while the step's budget and max_num_seqs allow, and
        the step holds fewer than ``room`` requests."""
        # After a preemption blocks are short: admitting more would only thrash.
        held = self.tenant_blocks() if self.config.tenant_kv_quota is not None and self._waiting else {}
        over_quota: set[str] = set()
        passed: dict[str, int] = {}  # tenant -> requests at its queue's head held back this step
        while (not out.preempted and budget.for_waiting > 0 and len(self._running) < self.config.max_num_seqs
               and len(out.scheduled) < room):
            req = self._waiting.pick(skip=over_quota, passed=passed)
            if req is None:
                break
            if self.shared_prompts.must_wait(req):
                passed[req.tenant] = passed.get(req.tenant, 0) + 1  # it starts from the cache later
                continue
            reason = self._never_fits(req)
            if reason:
                self._waiting.remove(req)
                self._end(req, RequestStatus.FINISHED_ABORTED, reason)
                out.aborted.append(req)
                continue
            n = self._admit(req, budget, out, held)
            if n == _OVER_QUOTA:
                over_quota.add(req.tenant)  # it waits; other tenants are not held up behind it
                continue
            if not n:
                break  # strict order: later requests never overtake the head, so long prompts don't starve
            self._waiting.remove(req)
            self._waiting.charge(req.tenant, n)
            budget.take(n, decode=False)
            self.shared_prompts.admitted(req)

    def _admit(self, req: Request, budget: StepBudget, out: SchedulerOutput, held: dict[str, int]) -> int:
        """Give a waiting request its first blocks; the number of tokens scheduled, 0 if it must wait,
        _OVER_QUOTA if its tenant may not take more blocks now (``held``: blocks per tenant, updated)."""
        swapped = req.swapped_blocks is not None
        computed: list[int] = []
        if not swapped:
            num_hit = 0
            # Prompt logprobs need logits for every prompt token, so such requests compute them all.
            if self.enable_prefix_caching and req.sampling_params.prompt_logprobs is None:
                computed, num_hit = self.block_manager.get_computed_blocks(req)
            req.num_computed_tokens = num_hit
        n = budget.fit(req.num_tokens - req.num_computed_tokens, budget.for_waiting)
        # the whole known sequence, not this step's chunk: later chunks grow without another check
        need = cdiv(req.num_tokens, self.block_manager.block_size)
        if n and self.over_quota(held.get(req.tenant, 0), need):
            if not swapped:
                req.num_computed_tokens = 0
            return _OVER_QUOTA
        if not n or not self.block_manager.allocate_slots(req, n, computed):
            if not swapped:
                req.num_computed_tokens = 0
            return 0
        if self.config.tenant_kv_quota is not None:
            held[req.tenant] = held.get(req.tenant, 0) + need
        if not swapped and req.status is RequestStatus.WAITING:  # first admission only
            req.num_cached_tokens = req.num_computed_tokens
        if swapped:
            device = self.block_manager.block_ids(req.request_id)
            out.swap_in.extend(zip(req.swapped_blocks, device, strict=False))
            # No swap-out can follow in this step (admission stops after a preemption), so these host
            # blocks are not reused before the runner has copied them in.
            self.host_pool.free(req.swapped_blocks)
            req.swapped_blocks = None
        req.status = RequestStatus.RUNNING
        self._insert_running(req)
        out.scheduled.append(ScheduledRequest(req, n, self.block_manager.block_ids(req.request_id)))
        return n

    def tenant_blocks(self, also: Iterable[Request] = ()) -> dict[str, int]:
        """Distinct KV blocks each tenant holds (running and held-for-handoff requests, and ``also``); shared
        prefix blocks count once. O(blocks in use), and only computed when a quota is set."""
        blocks: dict[str, set[int]] = {}
        for req in [*self._running, *self._held.values(), *also]:
            blocks.setdefault(req.tenant, set()).update(self.block_manager.req_blocks.get(req.request_id, ()))
        return {t: len(b) for t, b in blocks.items()}

    def over_quota(self, tenant_blocks: int, need: int) -> bool:
        return over_tenant_quota(self.config.tenant_kv_quota, tenant_blocks, need, self.block_manager.num_blocks)

    # ---- preemption ----

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput, at: int) -> bool:
        """Blocks for ``n`` more tokens of ``req`` (``self._running[at]``), preempting until they fit; False
        if ``req`` itself was preempted (and removed from the running list)."""
        while not self.block_manager.allocate_slots(req, n):
            victim = self._running.pop(self._victim(at))
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _victim(self, at: int) -> int:
        """The index of the running request to preempt for the one at ``at``. Only it and those after it, which
        the running loop has not reached yet, may go, so a request already scheduled this step is never
        preempted; nor is one in flight (busy), whose blocks its micro-batch still writes and whose token is
        not sampled yet. The tail goes first (the lowest priority under ``priority``), except that under a KV
        quota the tail-most request of a tenant holding more than its share goes before anyone else's: its
        requests grew past the quota by their decode tokens, and that growth should cost its own tenant, not
        one within its share."""
        order = [j for j in range(len(self._running) - 1, at - 1, -1) if self._running[j].request_id not in self._busy]
        if self.config.tenant_kv_quota is not None and len(order) > 1:
            held = self.tenant_blocks()
            over = next((j for j in order if self.over_quota(held.get(self._running[j].tenant, 0), 0)), None)
            if over is not None:
                return over
        return order[0]

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        out.preempted.append(req.request_id)
        num_data_blocks = cdiv(req.num_computed_tokens, self.block_manager.block_size)
        host = self.host_pool.allocate(num_data_blocks) if num_data_blocks else None
        if host is not None:
            device = self.block_manager.block_ids(req.request_id)[:num_data_blocks]
            out.swap_out.extend(zip(device, host, strict=True))
            req.swapped_blocks = host
        else:
            req.num_computed_tokens = 0  # recompute prompt + outputs on resume
        # The freed blocks may be handed out again this step; the runner copies swap_out first.
        self.block_manager.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        self._waiting.add(req, front=True)
