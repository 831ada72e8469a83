"""Turns a scheduler decision (request ids, token counts, block ids) into tensors, runs the model and
the sampler, and holds the paged KV cache (plus the host swap space) of one model: its allocation and
swap copies are kv_cache.py's, what a KV handoff asks of it handoff_hooks.py's (both mixed in here).

On CUDA a decode-only step (one new token per scheduled request) replays a captured CUDA graph
(shared/engine/cuda_graphs.py) unless ``enforce_eager``; prefill and mixed steps run eagerly, or under
``--cudagraph-mode FULL_AND_PIECEWISE`` in captured pieces around eager attention (piecewise_graphs.py). Either way a
step's integer inputs travel in one pinned non-blocking copy (shared/engine/step_inputs.py) and the only
host sync is the sampler reading back the sampled ids. With async scheduling ``launch`` replaces
``execute``: the sampled ids stay on the device, feed the next step's decode rows there, and the host
reads them later (shared/engine/async_step.py).
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvrelay.shared.config.engine import EngineConfig
from kvrelay.shared.engine.async_step import FedIds, LaunchedStep
from kvrelay.shared.engine.cuda_graphs import DecodeGraphs
from kvrelay.shared.engine.handoff_hooks import HandoffHooks
from kvrelay.shared.engine.kv_cache import RunnerKVCache
from kvrelay.shared.engine.kv_connector import KVLinks
from kvrelay.shared.engine.kv_dtype import attach_kv_scales, check_device, kv_cache_dtype
from kvrelay.shared.engine.kv_pool import KVPool
from kvrelay.shared.engine.kv_scales import cache_kv_scales, scales_digest
from kvrelay.shared.engine.loader import load_model
from kvrelay.shared.engine.logits_processors import penalized
from kvrelay.shared.engine.logprobs import prompt_logprobs
from kvrelay.shared.engine.outputs import PositionLogprobs
from kvrelay.shared.engine.parallel.state import SINGLE
from kvrelay.shared.engine.piecewise_graphs import PiecewiseGraphs, capture_piecewise
from kvrelay.shared.engine.ranks.driver_step import group_logits, logits_mode, step_frame, step_message
from kvrelay.shared.engine.ranks.group import RankGroup, TensorParallelError, start_ranks
from kvrelay.shared.engine.ranks.kv_inlet import InletDriver
from kvrelay.shared.engine.ranks.kv_parts import PartSender
from kvrelay.shared.engine.ranks.pipe_driver import (
    MicroBatch,
    land_micro_batch,
    launch_micro_batch,
    pipeline_step,
    receive,
)
from kvrelay.shared.engine.request import Request
from kvrelay.shared.engine.sampler import GrammarMask, Sampler, SampleResult
from kvrelay.shared.engine.scheduler_output import SchedulerOutput
from kvrelay.shared.engine.step_inputs import BlockTableCache, StepBatch, device_inputs, to_device_ints, to_host
from kvrelay.shared.engine.structured.manager import StructuredOutputManager
from kvrelay.shared.repo.model_shape import max_model_len as model_max_len


@dataclass
class StepResult:
    sampled: dict[str, SampleResult]  # request id -> the token sampled this step
    prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]]  # id -> (first position, logprobs of
    # the prompt tokens after it): a chunk covering positions p.. predicts prompt tokens p+1..


class ModelRunner(RunnerKVCache, HandoffHooks):
    def __init__(self, config: EngineConfig, kv_pool: KVPool | None = None, kv_floor_blocks: int | None = None,
                 kv_pool_key: str | None = None, loaded: tuple | None = None, model_root: Path | None = None,
                 kv_links: KVLinks | None = None):
        """``loaded``: (model, hf config) from ``load_model`` already, e.g. by a worker's loading thread
        that reads weights while its other models keep serving; else loaded here (``model_root``: the
        repository its files must resolve inside). ``kv_links``: with ranks, each sends its own part of
        handed-off KV (ranks/kv_parts.py); one process sends its KV as parts to a decode worker whose ranks
        each take their own share."""
        self.config = config
        self.device = torch.device(config.device)
        check_device(config.cache.kv_cache_dtype, self.device)
        # read (and checked) before any rank starts: every rank's layers take theirs from this table
        self.kv_scale_table = cache_kv_scales(config.model, config.cache.kv_cache_dtype, model_root)
        # tensor parallelism: ranks 1..N-1 start (and join the group) before this rank loads its shard. With
        # a KV pool shared with co-resident models, this rank's cache is its view of the pool and the others
        # each allocate a cache of the view's block count (RankAlloc), so every block id rank 0's block
        # manager is lent indexes the same block on every rank (holding each rank's own heads or layers)
        self.ranks: RankGroup | None = start_ranks(config, shared=loaded is not None, root=model_root, links=kv_links,
                                                   kv_scales=self.kv_scale_table)
        self.parts = PartSender(kv_links) if kv_links is not None else None  # no socket before its first part
        # the model's tensor-parallel peers (none in a pipeline); stage 0 of a pipeline is this rank's
        self.parallel = self.ranks.model_state if self.ranks is not None else SINGLE
        self.pipeline = config.pipeline_parallel_size
        self.inlets: InletDriver | None = None
        try:
            self._setup(kv_pool, kv_floor_blocks, kv_pool_key, loaded, model_root)
            if self.ranks is not None and kv_links is not None and kv_links.inlet_host is not None:
                self.inlets = InletDriver(self.ranks, self.model)  # each rank takes its own share of arriving KV
        except BaseException:
            self.close()
            raise

    def _setup(self, kv_pool: KVPool | None, kv_floor_blocks: int | None, kv_pool_key: str | None,
               loaded: tuple | None, root: Path | None) -> None:
        config = self.config
        self.model, self.hf_config = loaded or load_model(config.model, config.device, root=root,
                                                          parallel=self.parallel, pipeline=(0, self.pipeline))
        self.dtype = next(self.model.parameters()).dtype
        # what the KV cache stores (--kv-cache-dtype): the model's dtype, or fp8 with per-layer scales
        self.kv_dtype = kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.kv_scales = attach_kv_scales(self.model, self.device, self.kv_scale_table)  # [L, 2]: K, V
        self.kv_scales_digest = scales_digest(self.kv_scale_table, self.model.num_layers)  # "" unless fp8
        self.max_model_len = resolve_max_model_len(config, self.hf_config)
        self.block_size = config.cache.block_size
        self.sampler = Sampler()
        self.structured: StructuredOutputManager | None = None  # set by the engine core
        self._allocate_kv_cache(kv_pool, kv_floor_blocks, kv_pool_key)
        self._tables = BlockTableCache()
        # read every step, so a benchmark may flip it to time eager decode on the same loaded model
        self.enforce_eager = config.model.graph_mode == "NONE"  # --enforce-eager or --cudagraph-mode NONE
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        self.piecewise_on = True  # read every step, as enforce_eager is: a benchmark compares eager mixed steps
        if self.device.type == "cuda" and not self.enforce_eager and self.ranks is None:
            graphs = DecodeGraphs(self.model, self.kv_cache, config.scheduler.max_num_seqs, self.max_model_len,
                                  self.block_size)
            if graphs.capture():
                self.graphs = graphs
            if config.model.graph_mode == "FULL_AND_PIECEWISE":
                self.piecewise = capture_piecewise(self.model, self.kv_cache, config, self.max_model_len)

    # -- one step -------------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> StepResult:
        return self._in_group(self._execute, out)

    def launch(self, out: SchedulerOutput, fed: FedIds | None,
               before_mask: Callable[[], None] | None = None) -> LaunchedStep | None:
        """Async scheduling: queue the step and its sampling without waiting for the device. A decode
        row whose token is still pending takes it from ``fed`` (the previous step's sampled ids on the
        device; a rank group's other ranks get them in a broadcast from there, ranks/driver_step.py). None
        when nothing is scheduled (swap copies alone ran). With constrained rows (structured outputs),
        ``before_mask`` runs once the forward is queued and before their mask is filled: the caller reads
        the previous step's ids there, which the mask needs on the host."""
        return self._in_group(self._launch, out, fed, before_mask)

    def launch_micro(self, out: SchedulerOutput, in_flight: list[MicroBatch]) -> MicroBatch | None:
        """Pipeline batch queue (shared/engine/batch_queue.py): run ``out``'s swap copies, then launch it as
        one micro-batch behind ``in_flight`` without waiting for the later stages; None when nothing is
        scheduled."""
        return self._in_group(self._launch_micro, out, in_flight)

    def land(self, mb: MicroBatch) -> LaunchedStep:
        """Take a launched micro-batch's logits from the last stage and sample them."""
        return self._in_group(self._land, mb)

    def receive(self, mb: MicroBatch) -> None:
        """Wait until every stage is done with ``mb`` (its logits are here), sampling nothing yet."""
        self._in_group(receive, self, mb)

    def _in_group(self, run, *args):
        if self.ranks is None:
            return run(*args)
        try:
            return run(*args)
        except TensorParallelError:
            raise
        except RuntimeError as exc:  # a collective broke: a rank died, or the group is out of step
            raise self.ranks.down(exc) from exc

    @torch.inference_mode()
    def _execute(self, out: SchedulerOutput) -> StepResult:
        self._swap(out)
        if not out.scheduled:
            return StepResult({}, {})
        if self.pipeline > 1:  # micro-batches through the stages; the logits come back from the last
            sample_reqs, sample_logits, prompt, _ = pipeline_step(self, out)
        else:
            batch, sample_reqs, prompt_rows = self._build(out)
            sample_logits, logits_of = self._logits(out, batch, bool(sample_reqs), every_row=bool(prompt_rows))
            prompt = self._prompt_logprobs(prompt_rows, logits_of)
        result = StepResult({}, prompt)
        if sample_reqs:
            grammar = self._grammar_mask(sample_reqs)  # on the host while the device runs the forward
            for req, sample in zip(sample_reqs, self.sampler(sample_logits, sample_reqs, grammar), strict=True):
                result.sampled[req.request_id] = sample
        return result

    @torch.inference_mode()
    def _launch(self, out: SchedulerOutput, fed: FedIds | None,
                before_mask: Callable[[], None] | None) -> LaunchedStep | None:
        self._swap(out)
        if not out.scheduled:
            return None
        # prompt logprobs are read back in the step, a host sync: only steps that carry such a prompt pay it
        if self.pipeline > 1:
            sample_reqs, sample_logits, prompt, num_fed = pipeline_step(self, out, fed)
        else:
            fills: list[tuple[int, int]] = []  # (token row, index into fed.ids)
            batch, sample_reqs, prompt_rows = self._build(out, fed.rows if fed is not None else None, fills)
            sample_logits, logits_of = self._logits(out, batch, bool(sample_reqs), self._fed_fill(fills, fed),
                                                    every_row=bool(prompt_rows), fed_rows=[r for r, _ in fills])
            prompt, num_fed = self._prompt_logprobs(prompt_rows, logits_of), len(fills)
        step = LaunchedStep(out, sample_reqs, prompt, num_fed)
        if sample_reqs:
            read_early = before_mask is not None and any(r.grammar is not None and r.num_pending for r in sample_reqs)
            if read_early:
                before_mask()
            grammar = self._grammar_mask(sample_reqs)
            step.start_read(self.sampler.sample(sample_logits, sample_reqs, self._pending_ids(sample_reqs, fed),
                                                grammar))
            if read_early:  # requests that ended in the read were forgotten before this sampling made their
                for r in sample_reqs:  # per-request sampler state again (seeded generators, bias tensors)
                    if r.finished:
                        self.sampler.free(r.request_id)
        return step

    @torch.inference_mode()
    def _launch_micro(self, out: SchedulerOutput, in_flight: list[MicroBatch]) -> MicroBatch | None:
        self._swap(out)
        return launch_micro_batch(self, out, in_flight) if out.scheduled else None

    @torch.inference_mode()
    def _land(self, mb: MicroBatch) -> LaunchedStep:
        sample_reqs, sample_logits, prompt = land_micro_batch(self, mb)
        step = LaunchedStep(mb.out, sample_reqs, prompt, 0)
        step.started = mb.started
        if sample_reqs:
            step.start_read(self.sampler.sample(sample_logits, sample_reqs, None, self._grammar_mask(sample_reqs)))
            for r in sample_reqs:  # ended while in flight (an abort): this sampling made its sampler state again
                if r.finished:
                    self.sampler.free(r.request_id)
        return step

    def _fed_fill(self, fills: list[tuple[int, int]], fed: FedIds | None
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token rows, their ids taken from ``fed`` on the device) of ``_build``'s ``fills``; None without."""
        if not fills:
            return None
        rows, src = to_device_ints(list(zip(*fills, strict=True)), self.device)  # 2 x [F]
        return rows, fed.ids.index_select(0, src)

    def _grammar_mask(self, reqs: list[Request]) -> GrammarMask | None:
        """The constrained rows' token bitmask (structured outputs), filled on the host: called after the
        forward is queued, so on CUDA it overlaps the device's work; None without constrained rows."""
        if self.structured is None or all(r.grammar is None for r in reqs):
            return None
        return self.structured.bitmask(reqs)

    def _pending_ids(self, reqs: list[Request], fed: FedIds | None) -> torch.Tensor | None:
        """[R] int64 on the device: each sampling row's unread token (from ``fed``), -1 where it has none;
        None when no row needs it (only penalties count output tokens on the device)."""
        if fed is None or not any(r.num_pending and penalized(r.sampling_params) for r in reqs):
            return None
        src = to_device_ints([(fed.rows[r.request_id] if r.num_pending else -1,) for r in reqs], self.device)[:, 0]
        return torch.where(src >= 0, fed.ids.index_select(0, src.clamp(min=0)).long(), -1)

    def _logits(self, out: SchedulerOutput, batch: StepBatch, samples: bool,
                fill: tuple[torch.Tensor, torch.Tensor] | None = None, every_row: bool = False,
                fed_rows: list[int] | None = None):
        """Run the forward pass; returns (logits of the sampled rows [R, V] or None, logits_of(start,
        count) for prompt-logprob rows). ``fill``: (token rows, ids) written into the device input ids,
        ``fed_rows`` the same rows on the host (for the ranks' frame).
        ``every_row``: prompt-logprob rows follow (tensor parallelism forms all logits in one collective)."""
        graphs = self.graphs
        if graphs is not None and not self.enforce_eager and graphs.fits(batch):
            all_logits, rows = graphs.run(batch, fill)  # [S, V]: one token per sequence

            def logits_of(start: int, count: int) -> torch.Tensor:
                return all_logits[start:start + count]

            return (all_logits if batch.samples_every_row else all_logits.index_select(0, rows)), logits_of
        filled = to_host(batch, self.device) if self.ranks is not None else None
        if self.ranks is not None:  # every rank runs this step: its inputs go out before the forward
            mode = logits_mode(samples, every_row)
            fed_rows = fed_rows or []
            self.ranks.send(step_message(batch, filled[0], mode, len(fed_rows)), step_frame(filled[1], fed_rows))
            if fill is not None:  # the ranks take the fed ids from this device, never from the frame
                self.ranks.state.broadcast_from_driver(fill[1])
        t, meta = device_inputs(batch, self.device, filled, fill)
        if self._takes_pieces(batch):
            hidden = self.piecewise.run(t.input_ids, t.positions, meta)  # [T, hidden]
        else:
            hidden = self._forward(out, t, meta)  # [T, hidden]
        if self.ranks is not None:
            return group_logits(self.model, hidden, batch, t.sample_rows, mode)

        def logits_of(start: int, count: int) -> torch.Tensor:
            return self.model.compute_logits(hidden[start:start + count])

        sample_logits = None
        if samples:
            chosen = hidden if batch.samples_every_row else hidden.index_select(0, t.sample_rows)
            sample_logits = self.model.compute_logits(chosen)  # [R, V]
        return sample_logits, logits_of

    def _takes_pieces(self, batch: StepBatch) -> bool:
        # layer-by-layer KV streaming reports each eager layer as it ends, which the pieces do not
        pieces = self.piecewise
        return (pieces is not None and self.piecewise_on and not self.enforce_eager and self.kv_stream is None
                and pieces.fits(batch.num_tokens))

    def _prompt_logprobs(self, prompt_rows, logits_of) -> dict[str, tuple[int, list[PositionLogprobs]]]:
        found = {}
        for req, (row0, count, pos0) in prompt_rows:
            targets = req.prompt_token_ids[pos0 + 1:pos0 + 1 + count]
            k = req.sampling_params.prompt_logprobs
            entries = prompt_logprobs(logits_of(row0, count), targets, k)
            found[req.request_id] = (pos0, entries)
        return found

    def _build(self, out: SchedulerOutput, fed_rows: dict[str, int] | None = None,
               fills: list[tuple[int, int]] | None = None,
               ) -> tuple[StepBatch, list[Request], list[tuple[Request, tuple[int, int, int]]]]:
        """The step's flat batch on the host, the requests that sample (in row order), and the prompt
        logprob rows: (request, (first row, count, first position)). Async scheduling: a decode token
        the host has not read yet gets id 0 here and (row, ``fed_rows[id]``) in ``fills``."""
        bs = self.block_size
        batch = StepBatch([], [], [], [0], [], [], [])
        sample_reqs: list[Request] = []
        prompt_rows: list[tuple[Request, tuple[int, int, int]]] = []
        for sr in out.scheduled:
            req, start, n = sr.request, sr.request.num_computed_tokens, sr.num_new_tokens
            blocks = sr.block_ids
            row0 = batch.num_tokens
            if n == 1:  # decode: no ranges, no list copies of the whole sequence
                if start < req.num_tokens:
                    batch.input_ids.append(token_at(req, start))
                else:  # the previous step sampled it and it is still on the device
                    fills.append((row0, fed_rows[req.request_id]))
                    batch.input_ids.append(0)
                batch.positions.append(start)
                batch.slot_mapping.append(blocks[start // bs] * bs + start % bs)
            else:
                batch.input_ids.extend(token_slice(req, start, n))
                batch.positions.extend(range(start, start + n))
                batch.slot_mapping.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            batch.query_start_loc.append(batch.num_tokens)
            batch.seq_lens.append(start + n)
            batch.block_tables.append(self._tables.get(req.request_id, blocks))
            if sr.sample:
                batch.sample_rows.append(batch.num_tokens - 1)
                sample_reqs.append(req)
            if req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens:
                count = min(start + n, req.num_prompt_tokens - 1) - start  # positions predicting a prompt token
                if count > 0:
                    prompt_rows.append((req, (row0, count, start)))
        return batch, sample_reqs, prompt_rows

    def free_request(self, request_id: str) -> None:
        self.sampler.free(request_id)
        self._tables.drop(request_id)

    def check(self) -> None:
        """Raise ``TensorParallelError`` if the rank group is down (a rank died, seen by its watchdog)."""
        if self.ranks is not None:
            self.ranks.check()

    def abandon_ranks(self, waited_s: float) -> bool:
        """Take the rank group down from another thread, a step having waited ``waited_s`` on it
        (ranks/group.py ``abandon``). False without a group, or when it is down already."""
        return self.ranks is not None and self.ranks.abandon(waited_s)

    def release(self) -> None:
        """Unload: stop the ranks, then drop every tensor this runner holds (weights, the decode graphs and
        their memory pool, the KV view, the swap space), so the memory goes with this call, not with the last
        reference to the runner."""
        self.close()
        self.model = self.graphs = self.piecewise = self.inlets = None
        self.kv_cache = self.host_cache = self.kv_scales = None
        self.sampler, self._tables = Sampler(), BlockTableCache()

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (the runner cannot step afterwards)."""
        if self.ranks is not None:
            self.ranks.close()
        if self.parts is not None:
            self.parts.close()
        if self.inlets is not None:
            self.inlets.close()


def token_at(req: Request, pos: int) -> int:
    n_prompt = req.num_prompt_tokens
    return req.prompt_token_ids[pos] if pos < n_prompt else req.output_token_ids[pos - n_prompt]


def token_slice(req: Request, start: int, n: int) -> list[int]:
    """Tokens [start, start + n) of prompt + output without concatenating the two."""
    prompt, output = req.prompt_token_ids, req.output_token_ids
    p = len(prompt)
    if start >= p:
        return output[start - p:start - p + n]
    if start + n <= p:
        return prompt[start:start + n]
    return prompt[start:] + output[:start + n - p]


def resolve_max_model_len(config: EngineConfig, hf_config: dict) -> int:
    native = model_max_len(hf_config)
    wanted = config.model.max_model_len
    if wanted is None:
        return native
    if wanted < 1:
        raise ValueError(f"max_model_len must be positive, got {wanted}")
    if wanted > native and hf_config.get("model_type") != "bloom":  # ALiBi extrapolates; rope does not
        raise ValueError(f"max_model_len ({wanted}) exceeds the model's context ({native})")
    return wanted
