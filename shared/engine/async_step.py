"""Asynchronous scheduling (vLLM V1's ``--async-scheduling``): the host schedules step N+1 and launches it
while the device still runs step N, so scheduling, input building and launching leave the critical path.

The ids sampled at step N stay on the device (``FedIds``) and are scattered into step N+1's input ids
there; the host reads them one step later (a non-blocking copy into pinned memory plus a CUDA event,
waited on only after step N+1 is queued) to append them to the requests, check stops and emit outputs.
So at any time at most one step is unread, and each ``EngineCore.step`` call returns the previous step's
tokens.
With a tensor- or pipeline-parallel group, rank 0 schedules and samples, and its other ranks take the fed
ids from rank 0's device in a broadcast the step's message announces (shared/engine/ranks/driver_step.py).

What that costs and how outputs stay identical to synchronous stepping:
- a request sampled at step N counts its unread token as pending (``Request.num_pending``): the scheduler
  gives it its decode step, and min_tokens counts it;
- one that step N ends by length (max_tokens, max_model_len) is known to end without reading the token,
  so it is not scheduled, nor is one that can no longer fit a shrunk pool (aborted once its token is in); one that ends by EOS, a stop token, a stop string or an abort is only known a
  step later: it has run one step too many, whose token is discarded, and its blocks are freed then;
- the prefix cache registers a step's blocks once their ids are all read, before the next schedule, as
  in synchronous stepping, so prompts see the same cache hits;
- penalties count output tokens: the unread one joins the host's lists on the device (``pending`` of
  ``Sampler.sample``);
- structured outputs: a constrained row's grammar mask needs its previous token on the host, so a step
  with constrained rows reads the previous step once its own forward is queued, before filling the mask
  and sampling (the forward still takes its ids on the device; only the sampling waits).
"""

import dataclasses
import time
from collections.abc import Callable
from typing import Protocol

import torch

from kvrelay.shared.engine.block_manager import BlockManager
from kvrelay.shared.engine.observer import EngineObserver
from kvrelay.shared.engine.outputs import EngineCoreOutput, PositionLogprobs
from kvrelay.shared.engine.request import Request, RequestStatus
from kvrelay.shared.engine.sampler import DeviceSample, SampleResult
from kvrelay.shared.engine.scheduler import Scheduler, SchedulerOutput


@dataclasses.dataclass
class FedIds:
    """One step's sampled ids on the device, for the next step's decode rows."""

    ids: torch.Tensor  # [R] int32, the dtype of the input-id buffers
    rows: dict[str, int]  # request id -> index into ids


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy the device fills when it gets there (pinned, non-blocking); on the CPU the tensor is
    already the host's."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class LaunchedStep:
    """A step queued on the device whose sampled ids the host has not read yet."""

    def __init__(self, out: SchedulerOutput, sample_reqs: list[Request],
                 prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]], num_fed: int) -> None:
        self.out = out
        self.sample_reqs = sample_reqs
        self.prompt_logprobs = prompt_logprobs
        self.num_fed = num_fed  # decode rows whose input id came from the previous step on the device
        self.started = time.time()
        self.fed: FedIds | None = None
        self._drawn: DeviceSample | None = None
        self._host: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._ready: torch.cuda.Event | None = None

    def start_read(self, drawn: DeviceSample) -> None:
        """Keep the draw on the device for the next step and start its copy to the host."""
        ids = drawn.token_ids.to(torch.int32)
        self.fed = FedIds(ids, {r.request_id: i for i, r in enumerate(self.sample_reqs)})
        self._drawn = drawn
        self._host = (_to_host(ids), None if drawn.packed is None else _to_host(drawn.packed))
        if ids.device.type == "cuda":
            self._ready = torch.cuda.Event()
            self._ready.record()

    def read(self) -> dict[str, SampleResult]:
        """The sampled tokens by request id; waits for the device to have finished this step."""
        if self._drawn is None:
            return {}
        if self._ready is not None:
            self._ready.synchronize()
        ids, packed = self._host
        packed_rows = None if packed is None else packed.tolist()
        results = self._drawn.results(ids.tolist() if packed_rows is None else None, packed_rows)
        return {r.request_id: s for r, s in zip(self.sample_reqs, results, strict=True)}


class _Runner(Protocol):
    def launch(self, out: SchedulerOutput, fed: FedIds | None,
               before_mask: Callable[[], None] | None = None) -> LaunchedStep | None: ...


class AsyncStepper:
    """``EngineCore.step`` with async scheduling: launch the next step, then read the previous one.
    ``output`` builds a request's EngineCoreOutput (and forgets a finished one), as the core does;
    ``prompt_logprobs`` is the core's per-request table; ``observer`` returns its current observer."""

    def __init__(self, scheduler: Scheduler, runner: _Runner, block_manager: BlockManager,
                 output: Callable[[Request, SampleResult | None, bool], EngineCoreOutput],
                 prompt_logprobs: dict[str, list[PositionLogprobs | None]],
                 observer: Callable[[], EngineObserver | None]) -> None:
        self.scheduler, self.runner, self.block_manager = scheduler, runner, block_manager
        self.output, self.prompt_logprobs, self.observer = output, prompt_logprobs, observer
        self.inflight: LaunchedStep | None = None
        self.num_fed = 0  # decode tokens fed on the device (tests check the path is really taken)
        self.last_read = 0.0  # unix time the host last read a step's tokens

    @property
    def busy(self) -> bool:
        """Whether a step is in flight that the ranks still work on (never: this step's logits are back)."""
        return False

    def step(self) -> list[EngineCoreOutput]:
        sched, observer = self.scheduler, self.observer()
        outputs: list[EngineCoreOutput] = []
        prev = self.inflight
        started = time.time()
        out = sched.schedule()
        read_early = False

        def read_prev() -> None:
            # a constrained row's mask needs the token it sampled in prev: read prev now, with this step's
            # forward queued on the device, before the mask is filled and the step sampled
            nonlocal outputs, read_early
            if prev is not None:
                outputs += self._finish(prev, out)
                read_early = True

        cur = self.runner.launch(out, prev.fed if prev is not None else None, read_prev)
        sched.advance(out)  # after launch: the runner builds inputs from the counts before this step
        self.inflight = cur
        if cur is not None:
            cur.started = started
            self.num_fed += cur.num_fed
            for rid, (pos0, chunk) in cur.prompt_logprobs.items():
                self.prompt_logprobs[rid][pos0 + 1:pos0 + 1 + len(chunk)] = chunk
        if prev is not None and not read_early:
            outputs += self._finish(prev, out)  # the device runs cur meanwhile
        if cur is not None:
            for s in out.scheduled:  # every id of these blocks is known now that prev is read
                if s.request.status is RequestStatus.RUNNING:
                    self.block_manager.cache_blocks(s.request, s.request.num_computed_tokens)
        elif observer is not None:
            observer.on_step(started, out, [])
        if out.aborted:  # ended by the scheduler: reported now, not a step later
            outputs += [self.output(req, None, True) for req in out.aborted]
            if observer is not None:
                observer.on_removed(list(out.aborted))
        return outputs

    def _apply(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """The read tokens of ``out`` into the scheduler (advanced when launched); the requests they finish."""
        return self.scheduler.apply_sampled(out, sampled)

    def _finish(self, step: LaunchedStep, launched: SchedulerOutput | None = None) -> list[EngineCoreOutput]:
        """Read a launched step and turn it into outputs, as the synchronous step does. ``launched``: the step
        queued since (its host launch ran before this read, so inside this step's time)."""
        sampled = step.read()
        # A step's time for the step-cost fit: from its launch, or from the host's read of the step before it if
        # that is later (the device runs steps in order, so this one's work starts about then), to its tokens on
        # the host: the gap between two steps' outputs that inter-token latency sees, device and host alike.
        read = time.time()
        seconds = read - max(step.started, self.last_read)
        self.scheduler.record_step(step.out, seconds)
        self.last_read = read
        # requests that ended after this step was launched: their rows ran for nothing
        live = [s for s in step.out.scheduled if not s.request.status.finished]
        finished = {r.request_id: r for r in self._apply(step.out, {rid: s.token_id for rid, s in sampled.items()})}
        observer = self.observer()
        if observer is not None:
            beside = launched.shape if launched is not None and launched.scheduled else None
            observer.on_step(step.started, dataclasses.replace(step.out, scheduled=live, aborted=[], seconds=seconds,
                                                               beside=beside), list(finished.values()))
        outputs = []
        for sr in live:
            rid = sr.request.request_id
            sample = sampled.get(rid)
            if sample is None and rid not in finished:
                continue  # mid-prompt chunk
            outputs.append(self.output(sr.request, sample, rid in finished))
        return outputs
