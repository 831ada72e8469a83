"""Continuous-batching scheduler: each step, running requests first, then admitted waiting ones.

vLLM V1's unified model: there are no prefill and decode phases. Each step every request is granted up
to ``num_tokens - num_computed_tokens`` new tokens under the step's token budget (token_budget.py); a
request whose grant reaches ``num_tokens`` gets a token sampled by the runner. A long prompt is therefore
just a request that needs many tokens, and (with chunked prefill) takes them over several steps next to
decodes. Admission of waiting requests, tenant quotas and preemption are admission.py's (mixed in here).

The scheduler only moves block ids (scheduler_output.py); the runner executes the copies and the compute.
One step of an engine: ``out = schedule()``; run ``out`` (swap_out copies, then swap_in copies, then
the forward pass); ``update_from_output(out, sampled)``, also for an empty output. With async scheduling
``advance(out)`` when it is launched instead, and ``apply_sampled`` once its tokens are read, a step later.
With ``target_step_ms`` the engine also reports each step's wall time (``record_step``), which the prompt-token
cap of later steps follows (token_budget.py, step_cost.py).
"""

from kvrelay.shared.config.engine import SchedulerConfig
from kvrelay.shared.engine.admission import Admission
from kvrelay.shared.engine.block_manager import BlockManager
from kvrelay.shared.engine.fair_queue import FairWaitingQueue
from kvrelay.shared.engine.prompt_sharing import SharedPrompts
from kvrelay.shared.engine.request import Request, RequestStatus
from kvrelay.shared.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from kvrelay.shared.engine.step_cost import StepCost
from kvrelay.shared.engine.swap import HostBlockPool
from kvrelay.shared.engine.token_budget import StepBudget, is_decode, max_batched_tokens

_DONE_OK = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


class Scheduler(Admission):
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        num_host_blocks: int = 0,
        enable_prefix_caching: bool = True,
        hold_finished_kv: bool = False,
    ):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_batched_tokens(config, max_model_len)
        self.host_pool = HostBlockPool(num_host_blocks)
        self.enable_prefix_caching = enable_prefix_caching and block_manager.enable_prefix_caching
        # Disaggregated prefill: a finished request's KV must outlive it until handed off.
        self.hold_finished_kv = hold_finished_kv
        self._running: list[Request] = []
        self._waiting = FairWaitingQueue(config.policy, config.tenant_fairness)
        self.shared_prompts = SharedPrompts(block_manager.block_size, self.enable_prefix_caching)
        self._requests: dict[str, Request] = {}  # running + waiting
        self._held: dict[str, Request] = {}
        self._busy: frozenset[str] = frozenset()  # this schedule's requests still in flight (batch_queue.py)
        self.step_cost = StepCost() if config.target_step_ms else None
        self.last_prefill_cap: int | None = None  # the prompt-token cap of the last step that had decodes

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
        # its prompt's KV has landed: cached now, not at its first step here, so the handoff of a sibling or a
        # later turn granted before then reuses it (decode_worker/receiver.py) instead of receiving it again
        self.block_manager.cache_blocks(req, req.num_computed_tokens)

    # ---- scheduling ----

    def schedule(self, busy: frozenset[str] = frozenset(), max_seqs: int | None = None) -> SchedulerOutput:
        """``busy``: ids of running requests in a micro-batch still in flight (pipeline batch queue,
        batch_queue.py): neither scheduled nor preempted. ``max_seqs``: schedule at most this many requests."""
        out = SchedulerOutput()
        self._busy = busy
        budget = StepBudget(self.max_num_batched_tokens,
                            [r for r in self._running if r.request_id not in busy] if busy else self._running,
                            self.config, self.step_cost, floor=self.block_manager.block_size)
        # a pool can only shrink between steps (a co-resident model takes chunks back), not during one
        capacity = self.block_manager.capacity
        room = self.config.max_num_seqs if max_seqs is None else max_seqs
        i = 0
        while i < len(self._running) and budget.tokens > 0 and len(out.scheduled) < room:
            req = self._running[i]
            if req.request_id in busy:
                i += 1
                continue
            decode = is_decode(req)
            limit = budget.reach(decode)
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
            n = budget.fit(req.num_tokens + req.num_pending - req.num_computed_tokens, limit)
            if n <= 0:  # nothing left to compute, no budget left for it, or (chunking off) it would be split
                i += 1
                continue
            if not self._allocate_or_preempt(req, n, out, i):
                continue  # req preempted itself: the next request is at i now
            out.scheduled.append(ScheduledRequest(req, n, self.block_manager.block_ids(req.request_id)))
            self._waiting.charge(req.tenant, n)
            budget.take(n, decode, req.num_computed_tokens)
            i += 1

        self._admit_waiting(out, budget, room)
        out.num_batched_tokens = budget.used
        out.shape = budget.shape
        if budget.cap is not None:
            self.last_prefill_cap = budget.cap
        return out

    def record_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The wall time of the step ``out``, for the prompt-token cap of later ones (only a target reads it)."""
        if self.step_cost is not None:
            self.step_cost.observe(out.shape, seconds)

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
        self.shared_prompts.ended(req)
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

    @property
    def held_ids(self) -> list[str]:
        """Finished requests whose KV is held for a handoff (hold_finished_kv)."""
        return list(self._held)
