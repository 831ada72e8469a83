"""The engine core of one model: scheduler + block manager + model runner. Token ids in, token ids
out; no text. The offline API, the unified worker and both disaggregated workers drive this class.

Lifecycle of one request:
  make_request (validate) -> add_request (WAITING) -> step() grants it tokens, possibly in chunks
  (RUNNING) -> each step that reaches its last token samples one more -> a stop condition or
  abort() finishes it and frees its blocks (unless the core holds finished KV for a handoff).
A request whose prompt KV was computed elsewhere: blocks reserved through ``kv`` (kv_connector.py), the
KV written into them, then add_remote_prefilled (RUNNING, its first token already out).

This class is the engine's one public surface: workers, the handoff and benchmarks use it (and ``kv``)
and never its scheduler, block manager or runner. What it holds in memory and its unload (``release_kv``) it
inherits from core_memory.py.
"""

import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from kvrelay.shared.config.engine import EngineConfig
from kvrelay.shared.engine.async_step import AsyncStepper
from kvrelay.shared.engine.batch_queue import BatchQueueStepper
from kvrelay.shared.engine.block_manager import BlockManager, cdiv
from kvrelay.shared.engine.core_memory import CoreMemory
from kvrelay.shared.engine.kv_calibration import calculate_kv_scales
from kvrelay.shared.engine.kv_connector import KVLinks, engine_kv
from kvrelay.shared.engine.kv_pool import KVPool
from kvrelay.shared.engine.model_runner import ModelRunner
from kvrelay.shared.engine.observer import EngineObserver
from kvrelay.shared.engine.outputs import EngineCoreOutput, PositionLogprobs
from kvrelay.shared.engine.ranks.group import rank_device
from kvrelay.shared.engine.request import DEFAULT_TENANT, Request, RequestStatus
from kvrelay.shared.engine.request_checks import check_request
from kvrelay.shared.engine.resident_memory import ResidentMeter
from kvrelay.shared.engine.scheduler import Scheduler
from kvrelay.shared.engine.structured.compiling import CompilingRequests
from kvrelay.shared.engine.structured.manager import StructuredOutputManager, structured_tokenizer
from kvrelay.shared.wire.sampling_params import SamplingParams


class EngineCore(CoreMemory):
    def __init__(self, config: EngineConfig, hold_finished_kv: bool = False, kv_pool: KVPool | None = None,
                 kv_floor_blocks: int | None = None, kv_pool_key: str | None = None, loaded: tuple | None = None,
                 model_root: Path | None = None, kv_links: KVLinks | None = None):
        """``kv_pool``: a KV pool shared with co-resident models (shared/engine/kv_pool.py), attached to under
        ``kv_pool_key`` (default the model path) with a floor of ``kv_floor_blocks`` (default: one
        max_model_len sequence). Without one the model gets a private pool sized as configured.
        ``model_root``: the model repository the model's files must resolve inside, when the engine loads
        them itself (``loaded`` not given). ``kv_links``: a tensor- or pipeline-parallel engine's ranks send
        their own parts of handed-off KV with these (EngineKV.send_parts); without, rank 0 gathers it."""
        self.config = config
        self.memory = ResidentMeter(torch.device(config.device))  # what the model keeps besides weights and KV
        self.runner = runner = ModelRunner(config, kv_pool, kv_floor_blocks, kv_pool_key, loaded, model_root,
                                           kv_links)
        self.max_model_len = runner.max_model_len
        self.vocab_size: int = runner.model.vocab_size
        pool, key = runner.kv_pool, runner.kv_pool_key
        self.block_manager = BlockManager(
            runner.kv_cache.shape[2], config.cache.block_size, config.cache.enable_prefix_caching,
            owned=runner.kv_block_ids, grow=lambda n: pool.grow(key, n), capacity=lambda: pool.capacity(key),
        )
        pool.bind(key, self.block_manager)
        self.scheduler = Scheduler(
            config.scheduler, self.block_manager, self.max_model_len,
            num_host_blocks=self.runner.num_host_blocks,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            hold_finished_kv=hold_finished_kv,
        )
        self.kv = engine_kv(runner, self.block_manager, self.scheduler.release_held)
        self._prompt_logprobs: dict[str, list[PositionLogprobs | None]] = {}
        tokenizer_dir, no_tokenizer = structured_tokenizer(config)
        self.structured = runner.structured = StructuredOutputManager(tokenizer_dir, no_tokenizer)
        self._compiling = CompilingRequests()
        self.observer: EngineObserver | None = None
        self.stepper: AsyncStepper | None = None
        if config.uses_batch_queue:
            self.stepper = self.new_stepper()
        elif config.async_scheduling:
            if hold_finished_kv:  # the handoff wants each prompt's first token and its KV at once
                raise ValueError("--async-scheduling is for unified and decode engines, not a prefill worker's")
            self.stepper = self.new_stepper()
        elif config.async_scheduling is None and runner.device.type == "cuda" and not hold_finished_kv:
            self.stepper = self.new_stepper()
        if config.cache.calculate_kv_scales:  # before any request can write a block (kv_calibration.py)
            calculate_kv_scales(self)
        self.memory.built(runner)

    def new_stepper(self) -> AsyncStepper:
        """The async-scheduling step of this core (benchmarks switch it on and off between runs); under
        pipeline parallelism with ``pipeline_batch_queue``, the batch queue's, which supersedes it."""
        args = (self.scheduler, self.runner, self.block_manager, self._output, self._prompt_logprobs,
                lambda: self.observer)
        if self.config.uses_batch_queue:
            return BatchQueueStepper(*args, depth=self.config.pipeline_parallel_size)
        return AsyncStepper(*args)

    # -- requests -------------------------------------------------------------------------------
    def make_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        eos_token_id: int | None = None, priority: int = 0, cache_salt: str | None = None,
        tenant: str = DEFAULT_TENANT, arrival: float | None = None,
    ) -> Request:
        """Validate one n=1 request against this model; raises ValueError naming the problem.
        ``arrival``: unix time it entered the system (workers pass the Job's); default now."""
        max_tokens = check_request(prompt_token_ids, params, self.vocab_size, self.max_model_len,
                                   self.block_manager.block_size, self.block_manager.capacity)
        req = Request(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling_params=params,
            eos_token_id=eos_token_id, max_tokens=max_tokens, priority=priority, cache_salt=cache_salt,
            tenant=tenant, arrival_wall=time.time() if arrival is None else arrival,
        )
        self.structured.attach(req)  # its constraint starts compiling now, on the compile thread
        error = req.grammar.error if req.grammar is not None else None
        if error is not None:  # a constraint already known not to compile fails at once
            raise ValueError(error)
        return req

    def add_request(self, req: Request) -> None:
        if req.sampling_params.prompt_logprobs is not None:
            # the first prompt token has no logprob; positions are filled as chunks compute (a recompute
            # after preemption overwrites the same slots)
            self._prompt_logprobs[req.request_id] = [None] * req.num_prompt_tokens
        if not self._compiling.hold(req, remote=False):
            self.scheduler.add_request(req)

    def add_remote_prefilled(self, req: Request, first_token_id: int, num_cached_tokens: int) -> None:
        """Admit a request whose prompt KV was computed elsewhere and sits in the blocks ``kv.reserve``
        gave it, with the first token the other side sampled as its output 0. The caller has checked
        that it fits the running batch (``num_running < max_num_seqs``). A constrained one continues its
        grammar from that token (its matcher catches up before its first mask here)."""
        req.output_token_ids = [first_token_id]
        req.num_computed_tokens = req.num_prompt_tokens
        req.num_cached_tokens = num_cached_tokens
        if not self._compiling.hold(req, remote=True):
            self.scheduler.add_prefilled_request(req)

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Requests whose constraint finished compiling join the scheduler; those whose constraint does not
        compile end with an "error" output carrying the compile's message."""
        if not self._compiling:
            return []
        outputs, failed = [], []
        for req, remote in self._compiling.take_ready(idle=not self.scheduler.has_unfinished()):
            rid, error = req.request_id, req.grammar.error
            if error is not None:
                if remote:
                    self.kv.free(rid)
                req.status = RequestStatus.FINISHED_ABORTED
                self._forget(rid)
                failed.append(req)
                outputs.append(EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason="error", error=error,
                                                num_prompt_tokens=req.num_prompt_tokens))
            elif remote:
                self.scheduler.add_prefilled_request(req)
            else:
                self.scheduler.add_request(req)
        if failed and self.observer is not None:
            self.observer.on_removed(failed)
        return outputs

    def abort(self, request_ids: list[str]) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self._drop_compiling(rid) or self.scheduler.abort_request(rid)
            if req is not None:
                self._forget(rid)
                aborted.append(req)
        if aborted and self.observer is not None:
            self.observer.on_removed(aborted)
        return aborted

    def finish(self, request_id: str) -> None:
        """Stop a request from outside (a stop string matched in the detokenizer)."""
        req = self._drop_compiling(request_id) or self.scheduler.finish_request(
            request_id, RequestStatus.FINISHED_STOPPED)
        if req is not None:
            self._forget(request_id)
            if self.observer is not None:
                self.observer.on_removed([req])

    def _drop_compiling(self, request_id: str) -> Request | None:
        """Take a request still waiting for its compile out of the engine (aborted); None if it is not one."""
        entry = self._compiling.drop(request_id)
        if entry is None:
            return None
        req, remote = entry
        if remote:
            self.kv.free(request_id)
        req.status = RequestStatus.FINISHED_ABORTED
        return req

    def has_unfinished(self) -> bool:
        # a batch queue's micro-batches in flight must land even when all their requests ended meanwhile
        busy = self.stepper is not None and self.stepper.busy
        return self.scheduler.has_unfinished() or bool(self._compiling) or busy

    # -- stepping -------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        failed = self._admit_compiled()
        if self.stepper is not None:  # async scheduling: returns the previous step's tokens
            return failed + self.stepper.step()
        started = time.time()
        out = self.scheduler.schedule()
        result = self.runner.execute(out)
        sampled = {rid: [s.token_id] for rid, s in result.sampled.items()}
        for rid, (pos0, chunk) in result.prompt_logprobs.items():
            self._prompt_logprobs[rid][pos0 + 1:pos0 + 1 + len(chunk)] = chunk
        finished = {r.request_id: r for r in self.scheduler.update_from_output(out, sampled)}
        out.seconds = time.time() - started
        self.scheduler.record_step(out, out.seconds)
        if self.observer is not None:
            self.observer.on_step(started, out, list(finished.values()))
        outputs = []
        emitted_done: list[str] = []  # finished requests already reported from the scheduled pass
        for sr in out.scheduled:
            req = sr.request
            rid = req.request_id
            sample = result.sampled.get(rid)
            done = rid in finished
            if sample is None and not done:
                continue  # mid-prompt chunk: nothing to report yet
            outputs.append(self._output(req, sample, done))
            if done:
                emitted_done.append(rid)
        for rid, req in finished.items():  # aborted, or ended without a sample this step
            if rid not in result.sampled and rid not in emitted_done:
                outputs.append(self._output(req, None, True))
        return failed + outputs

    def _output(self, req: Request, sample, done: bool) -> EngineCoreOutput:
        rid = req.request_id
        item = EngineCoreOutput(
            request_id=rid,
            new_token_ids=[sample.token_id] if sample else [],
            new_logprobs=[sample.position_logprobs()] if sample and req.sampling_params.logprobs is not None else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
        )
        if sample and req.num_output_tokens == 1 and rid in self._prompt_logprobs:
            item.prompt_logprobs = self._prompt_logprobs[rid]
        if done:
            item.finish_reason = req.status.value
            item.stop_reason = req.stop_reason
            self._forget(rid)
        return item

    def _forget(self, request_id: str) -> None:
        self._prompt_logprobs.pop(request_id, None)
        self.runner.free_request(request_id)

    def abort_all(self) -> list[Request]:
        """Abort every unfinished request and free the KV held for handoffs: what an unload after a failure
        (a load whose warm-up raised, a benchmark's error mid-run) does first, so that ``release_kv``
        succeeds and the failure, not the release's refusal, is what is reported."""
        return self.abort([r.request_id for r in self.scheduling_order()] + self.scheduler.held_ids)

    def shutdown(self) -> None:
        """Stop what runs beside this core (tensor-parallel ranks); it cannot step afterwards."""
        self.runner.close()

    def check(self) -> None:
        """Raise ``TensorParallelError`` once a rank of the model's group has died, also between steps:
        a worker with nothing to step would otherwise stay registered with a group that cannot serve."""
        self.runner.check()

    def abandon_ranks(self, waited_s: float) -> bool:
        """From another thread, while a step has waited ``waited_s`` on the model's rank group (a rank stopped
        or wedged): take the group down, so the step raises ``TensorParallelError``. False without a group."""
        return self.runner.abandon_ranks(waited_s)

    # -- introspection for workers and metrics --------------------------------------------------
    def is_running(self, request_id: str) -> bool:
        return self._compiling.holds_seat(request_id) or any(r.request_id == request_id
                                                             for r in self.scheduler.running)

    def scheduling_order(self) -> Iterator[Request]:
        """Unfinished requests in the order a step serves them: running first, then waiting."""
        yield from self.scheduler.running
        yield from self.scheduler.waiting
        yield from self._compiling.requests()

    @property
    def num_running(self) -> int:
        # a handed-off request waiting for its compile holds a decode seat already
        return self.scheduler.num_running + self._compiling.num_remote

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting + self._compiling.num_local

    @property
    def max_num_seqs(self) -> int:
        return self.config.scheduler.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        """The step's token budget (resolved: the config may leave it to the engine)."""
        return self.scheduler.max_num_batched_tokens

    @property
    def kv_usage(self) -> float:
        """Fraction of this model's blocks in use (1 = full)."""
        return self.block_manager.usage

    def prompt_budget(self) -> tuple[int | None, tuple[float, float, float, float] | None]:
        """The prompt-token cap of the last step that had decodes (None before any), and the step-cost fit that
        --target-step-ms follows (seconds fixed, per decode row, per context token, per prompt token; None when
        off or not yet warm)."""
        fit = self.scheduler.step_cost
        return self.scheduler.last_prefill_cap, fit.coefficients() if fit is not None and fit.warm else None

    def prefix_cache_stats(self) -> tuple[int, int]:
        """Lifetime prompt tokens looked up in the prefix cache, and those found."""
        return self.block_manager.prefix_queries, self.block_manager.prefix_hits

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV cache stores: ``dtype``, or float8_e4m3fn with ``--kv-cache-dtype fp8``."""
        return self.runner.kv_dtype

    @property
    def hf_config(self) -> dict:
        return self.runner.hf_config

    def rank_processes(self) -> list[tuple[int, int, str]]:
        """(rank, pid, device) of each process of this model, rank 0 (this one) first."""
        pids = [os.getpid(), *(self.runner.ranks.pids if self.runner.ranks is not None else ())]
        return [(rank, pid, str(rank_device(self.config.device, rank))) for rank, pid in enumerate(pids)]

    @property
    def num_free_blocks(self) -> int:
        """Free blocks this model owns (a shared pool may hold more it could grow into)."""
        return self.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        """Blocks this model owns now."""
        return self.block_manager.num_blocks

    @property
    def scheduling_policy(self) -> str:
        """--scheduling-policy: a request's ``priority`` orders admission only under "priority"."""
        return self.config.scheduler.policy

    # -- tenant KV quota (--tenant-kv-quota), for a decode worker's grants ------------------------
    @property
    def tenant_kv_quota(self) -> float | None:
        return self.config.scheduler.tenant_kv_quota

    def tenant_kv_blocks(self) -> dict[str, int]:
        """KV blocks each tenant's requests hold here (running, held for a handoff, seated while compiling).
        O(blocks in use): asked only when a quota is set."""
        return self.scheduler.tenant_blocks(self._compiling.requests())

    def over_tenant_kv_quota(self, tenant_blocks: int, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` tokens would take a tenant holding ``tenant_blocks`` blocks past
        its quota: the rule admission applies to waiting requests (admission.py)."""
        return self.scheduler.over_quota(tenant_blocks, cdiv(num_tokens, self.block_size))


__all__ = ["EngineCore", "EngineObserver"]
