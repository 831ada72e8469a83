"""Continuous-batching scheduler: token budget, chunked prefill, prefix-cache reuse, preemption.

vLLM V1's unified model: there are no prefill and decode phases. Each step every request is granted up
to ``num_tokens - num_computed_tokens`` new tokens under the step's token budget; a request whose grant
reaches ``num_tokens`` gets a token sampled by the runner. A long prompt is therefore just a request
that needs many tokens, and (with chunked prefill) takes them over several steps next to decodes.

Each step serves running requests first, in order, then admits waiting ones. Decodes come before prompt
chunks in the budget: a prompt chunk is granted only what leaves a token for every decode after it in
the list. While any request decodes, the step's prompt tokens are also capped at
``max_prefill_tokens_with_decodes`` (Sarathi-Serve's stall-free batching), so a decode step costs about
the same with or without a long prompt beside it; with nothing decoding a prompt takes the whole budget.

When a running request cannot get blocks, the lowest-priority running request (the list's tail) is
preempted: swapped to host memory when there is room, otherwise dropped and recomputed later. The
scheduler only moves block ids; the runner executes the copies in ``SchedulerOutput`` and the compute.

Tenants (``SchedulerConfig.tenant_fairness``, on by default): admission picks between tenants by the
tokens each has been served (``fair_queue.py``), so one tenant's flood cannot starve another; within a
tenant the policy's order holds. With ``tenant_kv_quota`` a tenant's request is admitted only if the
blocks of its whole known sequence fit under that share of the pool together with what the tenant
holds; otherwise it waits, and other tenants are admitted past it. Running requests still grow by
their decode tokens, and a tenant holding no blocks can always start one request, so a quota never
makes a request unservable.

One step of an engine: ``out = schedule()``; run ``out`` (swap_out copies, then swap_in copies, then
the forward pass); ``update_from_output(out, sampled)``, also for an empty output. With async scheduling
``advance(out)`` when it is launched instead, and ``apply_sampled`` once its tokens are read, a step later.
"""

import bisect
from dataclasses import dataclass, field

from kvrelay.shared.config.engine import SchedulerConfig
from kvrelay.shared.engine.block_manager import BlockManager, cdiv
from kvrelay.shared.engine.fair_queue import FairWaitingQueue
from kvrelay.shared.engine.request import Request, RequestStatus
from kvrelay.shared.engine.swap import HostBlockPool


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_ids: list[int]  # full block table after allocation
    # This step computes the request's last known token, so the runner samples one. Fixed at schedule
    # time because update_from_output moves num_computed_tokens.
    sample: bool = field(init=False)

    def __post_init__(self) -> None:
        req = self.request  # a pending token (async scheduling) is known to exist, so it counts
        self.sample = req.num_computed_tokens + self.num_new_tokens == req.num_tokens + req.num_pending


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    aborted: list[Request] = field(default_factory=list)  # ended by the scheduler: can never fit

    @property
    def empty(self) -> bool:
        # Swap copies alone still need the runner: a swapped-out block may be reused next step.
        return not (self.scheduled or self.swap_out or self.swap_in)


_DONE_OK = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
_OVER_QUOTA = -1  # _admit: the request's tenant is at its KV quota; other tenants may still be admitted


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        num_host_blocks: int = 0,
        enable_prefix_caching: bool = True,
        hold_finished_kv: bool = False,
    ):
        budget = config.max_num_batched_tokens
        if budget is None:
            budget = 2048 if config.enable_chunked_prefill else max_model_len
        if budget < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {budget}")
        if not config.enable_chunked_prefill and budget < max_model_len:
            # Without chunking a whole prompt must fit one step, or the longest prompts could never run.
            raise ValueError(
                f"max_num_batched_tokens ({budget}) must be >= max_model_len ({max_model_len}) "
                "when chunked prefill is disabled"
            )
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = budget
        self.host_pool = HostBlockPool(num_host_blocks)
        self.enable_prefix_caching = enable_prefix_caching and block_manager.enable_prefix_caching
        # Disaggregated prefill: a finished request's KV must outlive it until handed off.
        self.hold_finished_kv = hold_finished_kv
        self._running: list[Request] = []
        self._waiting = FairWaitingQueue(config.policy, config.tenant_fairness)
        self._requests: dict[str, Request] = {}  # running + waiting
        self._held: dict[str, Request] = {}

    # ---- queues ----

    @property
    def running(self) -> list[Request]:
        return list(self._running)

    @property
    def waiting(self) -> list[Request]:
        return self._waiting.requests()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    def _order(self, req: Request) -> tuple[int, float]:
        return (req.priority, req.arrival_time)

    def _insert_running(self, req: Request) -> None:
        if self.config.policy == "priority":
            bisect.insort(self._running, req, key=self._order)
        else:
            self._running.append(req)

    @property
    def tenant_counters(self) -> dict[str, int]:
        """Virtual tokens served per tenant (what fair admission compares); for tests and debugging."""
        return dict(self._waiting.counters)

    def _check_new(self, req: Request) -> None:
        if req.request_id in self._requests or req.request_id in self._held:
            raise ValueError(f"request id {req.request_id!r} is already in the scheduler")

    def add_request(self, req: Request) -> None:
        self._check_new(req)
        req.status = RequestStatus.WAITING
        self._requests[req.request_id] = req
        self._waiting.enter(req.tenant)
        self._waiting.add(req)

    def add_prefilled_request(self, req: Request) -> None:
        """Admit a request whose prompt KV already sits in blocks from ``allocate_for_tokens``.

        The caller sets ``num_computed_tokens`` and puts the first sampled token in the output; it
        also checks ``num_running < max_num_seqs`` before accepting the handoff."""
        self._check_new(req)
        capacity = len(self.block_manager.block_ids(req.request_id)) * self.block_manager.block_size
        if not 0 < req.num_computed_tokens <= min(capacity, req.num_tokens):
            raise ValueError(
                f"request {req.request_id}: num_computed_tokens={req.num_computed_tokens} must be in "
                f"(0, min(allocated slots {capacity}, num_tokens {req.num_tokens})]"
            )
        req.status = RequestStatus.RUNNING
        self._requests[req.request_id] = req
        self._waiting.enter(req.tenant)
        self._insert_running(req)

    # ---- scheduling ----

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

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        # Decodes not yet reached in the list: a prompt chunk leaves a token for each of them.
        reserve = sum(map(self._decoding, self._running))
        cap = self.config.max_prefill_tokens_with_decodes
        # Without chunking a prompt cannot be split to fit a cap, so it would only wait.
        prefill_left = cap if reserve and chunked and cap else budget

        # a pool can only shrink between steps (a co-resident model takes chunks back), not during one
        capacity = self.block_manager.capacity
        i = 0
        while i < len(self._running) and budget > 0:
            req = self._running[i]
            decoding = self._decoding(req)
            reserve -= decoding
            if req.num_pending and (self._ends_by_length(req) or self._never_fits(req, capacity, req.num_pending)):
                # async: its unread token ends it, or it can never fit: no step for it; reading the token
                # ends it, or the next schedule aborts it as synchronous stepping would (aborting it now
                # would drop that token)
                i += 1
                continue
            reason = self._never_fits(req, capacity)
            if reason:
                self._running.pop(i)
                self._end(req, RequestStatus.FINISHED_ABORTED, reason)
                out.aborted.append(req)
                continue
            n = req.num_tokens + req.num_pending - req.num_computed_tokens
            limit = budget if decoding else min(budget - reserve, prefill_left)
            if n <= 0 or limit <= 0 or (not chunked and n > limit):  # chunking off: never split a running request
                i += 1
                continue
            n = min(n, limit)
            if self._allocate_or_preempt(req, n, out):
                out.scheduled.append(ScheduledRequest(req, n, self.block_manager.block_ids(req.request_id)))
                self._waiting.charge(req.tenant, n)
                budget -= n
                prefill_left -= 0 if decoding else n
            i += 1  # if req preempted itself it was the tail, and the loop ends here

        # After a preemption blocks are short: admitting more would only thrash.
        held = self._tenant_blocks() if self.config.tenant_kv_quota is not None and self._waiting else {}
        over_quota: set[str] = set()
        while not out.preempted and min(budget, prefill_left) > 0 and len(self._running) < self.config.max_num_seqs:
            req = self._waiting.pick(skip=over_quota)
            if req is None:
                break
            reason = self._never_fits(req)
            if reason:
                self._waiting.remove(req)
                self._end(req, RequestStatus.FINISHED_ABORTED, reason)
                out.aborted.append(req)
                continue
            n = self._admit(req, min(budget, prefill_left), chunked, out, held)
            if n == _OVER_QUOTA:
                over_quota.add(req.tenant)  # it waits; other tenants are not held up behind it
                continue
            if not n:
                break  # strict order: later requests never overtake the head, so long prompts don't starve
            self._waiting.remove(req)
            self._waiting.charge(req.tenant, n)
            budget -= n
            prefill_left -= n

        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    @staticmethod
    def _decoding(req: Request) -> bool:
        """Past its prompt, needing one token: a decode row (with async scheduling the token it needs
        is the pending one)."""
        return bool(req.num_output_tokens + req.num_pending) and \
            req.num_tokens + req.num_pending - req.num_computed_tokens == 1

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        # Victims come from the tail, which the running loop has not reached yet, so a request that is
        # already scheduled this step is never preempted.
        while not self.block_manager.allocate_slots(req, n):
            victim = self._running.pop()
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

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

    def _tenant_blocks(self) -> dict[str, int]:
        """Distinct KV blocks each tenant holds (running and held-for-handoff requests); shared prefix
        blocks count once. O(blocks in use), and only computed when a quota is set."""
        blocks: dict[str, set[int]] = {}
        for req in [*self._running, *self._held.values()]:
            blocks.setdefault(req.tenant, set()).update(self.block_manager.req_blocks.get(req.request_id, ()))
        return {t: len(b) for t, b in blocks.items()}

    def _admit(self, req: Request, budget: int, chunked: bool, out: SchedulerOutput, held: dict[str, int]) -> int:
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
        n = req.num_tokens - req.num_computed_tokens
        if n > budget and not chunked:
            n = 0
        n = min(n, budget)
        # the whole known sequence, not this step's chunk: later chunks grow without another check
        need = cdiv(req.num_tokens, self.block_manager.block_size)
        if n and self._over_quota(held.get(req.tenant, 0), need):
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

    def _over_quota(self, tenant_blocks: int, need: int) -> bool:
        quota = self.config.tenant_kv_quota
        if quota is None or tenant_blocks == 0:
            return False
        return tenant_blocks + need > quota * self.block_manager.num_blocks

    # ---- results and endings ----

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Advance the scheduled requests by the step's results; returns the requests that finished."""
        finished = list(out.aborted)
        for s in out.scheduled:
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue  # finished or aborted between schedule() and now
            tokens = sampled.get(req.request_id, ())
            if tokens and not s.sample:
                raise ValueError(f"request {req.request_id}: tokens sampled for a step that ends mid-prompt")
            req.num_computed_tokens += s.num_new_tokens
            status = None
            for token in tokens:
                req.output_token_ids.append(token)
                status = self._check_stop(req)
                if status:
                    break  # tokens past a stop are dropped
            self.block_manager.cache_blocks(req, req.num_computed_tokens)
            if status:
                self._end(req, status)
                finished.append(req)
        if len(finished) > len(out.aborted):
            self._running = [r for r in self._running if r.status is RequestStatus.RUNNING]
        return finished

    # ---- async scheduling (shared/engine/async_step.py): a step is advanced when launched, and its
    # sampled tokens are applied a step later, after the next step has been scheduled ----

    def advance(self, out: SchedulerOutput) -> None:
        """The step ``out`` is launched: count its tokens computed, and its samples as pending."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            s.request.num_pending += s.sample

    def apply_sampled(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """The host has read the tokens of ``out`` (advanced earlier): append them and check stops. One
        preempted meanwhile still gets its token; one finished meanwhile (abort, stop string) has it
        discarded. Returns the requests this finished."""
        finished = []
        for s in out.scheduled:
            req = s.request
            if not s.sample or req.status.finished:
                continue
            req.num_pending -= 1
            req.output_token_ids.append(sampled[req.request_id])
            status = self._check_stop(req)
            if status:
                if req.status is not RequestStatus.RUNNING:  # preempted after it sampled
                    self._waiting.remove(req)
                self._end(req, status)  # a running one leaves the running list below
                finished.append(req)
        if finished:
            self._running = [r for r in self._running if r.status is RequestStatus.RUNNING]
        return finished

    def _ends_by_length(self, req: Request) -> bool:
        total = req.num_tokens + req.num_pending
        return req.num_output_tokens + req.num_pending >= req.max_tokens or total >= self.max_model_len

    def _check_stop(self, req: Request) -> RequestStatus | None:
        sp = req.sampling_params
        last = req.output_token_ids[-1]
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and req.eos_token_id is not None and last == req.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if last in sp.stop_token_ids:
                req.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _end(self, req: Request, status: RequestStatus, reason: str | None = None) -> None:
        """Mark finished and release its memory; the caller has taken it out of its queue."""
        req.status = status
        if reason is not None:
            req.stop_reason = reason
        del self._requests[req.request_id]
        self._waiting.leave(req.tenant)
        if req.swapped_blocks is not None:
            self.host_pool.free(req.swapped_blocks)
            req.swapped_blocks = None
        if self.hold_finished_kv and status in _DONE_OK:
            self._held[req.request_id] = req
        else:
            self.block_manager.free(req.request_id)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request from outside (stop strings, aborts). Unknown ids: None. Aborting a held request
        releases its KV."""
        if not status.finished:
            raise ValueError(f"finish_request needs a finished status, got {status}")
        req = self._requests.get(request_id)
        if req is None:
            if status is RequestStatus.FINISHED_ABORTED and request_id in self._held:
                req = self._held[request_id]
                self.release_held(request_id)
            return req
        if req.status is RequestStatus.RUNNING:
            self._running.remove(req)
        else:
            self._waiting.remove(req)
        self._end(req, status)
        return req

    def abort_request(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def release_held(self, request_id: str) -> None:
        """The held KV has been handed off (or is no longer wanted): free its blocks."""
        if self._held.pop(request_id, None) is not None:
            self.block_manager.free(request_id)

    @property
    def num_held(self) -> int:
        return len(self._held)
