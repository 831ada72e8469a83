"""Turns a scheduler decision (request ids, token counts, block ids) into tensors, runs the model and
the sampler, and owns the paged KV cache (plus the host swap space) of one model."""

import logging
import math
from dataclasses import dataclass

import torch

from kernels import AttentionMetadata
from shared.config import EngineConfig
from shared.loader import load_model
from shared.models import max_model_len as model_max_len
from shared.outputs import Logprob, PositionLogprobs
from shared.request import Request
from shared.sampler import Sampler, SampleResult, prompt_logprobs
from shared.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30


@dataclass
class StepResult:
    sampled: dict[str, SampleResult]  # request id -> the token sampled this step
    prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]]  # id -> (first position, logprobs of
    # the prompt tokens after it): a chunk covering positions p.. predicts prompt tokens p+1..


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.model, self.hf_config = load_model(config.model, config.device)
        self.dtype = next(self.model.parameters()).dtype
        self.max_model_len = resolve_max_model_len(config, self.hf_config)
        self.block_size = config.cache.block_size
        self.sampler = Sampler()
        self.num_blocks = self._num_kv_blocks()
        max_blocks_per_seq = math.ceil(self.max_model_len / self.block_size)
        if self.num_blocks < max_blocks_per_seq:
            raise ValueError(
                f"KV cache too small: {self.num_blocks} blocks of {self.block_size} tokens hold "
                f"{self.num_blocks * self.block_size} tokens, but one sequence of max_model_len={self.max_model_len} "
                f"needs {max_blocks_per_seq} blocks; raise the KV memory or lower max_model_len"
            )
        self.kv_cache = torch.zeros(self.kv_shape(self.num_blocks), dtype=self.dtype, device=self.device)
        self.num_host_blocks = int(config.cache.swap_space * (1 << 30)) // self.block_bytes
        self.host_cache = None
        if self.num_host_blocks:
            pin = self.device.type == "cuda"
            self.host_cache = torch.zeros(self.kv_shape(self.num_host_blocks), dtype=self.dtype, pin_memory=pin)
        log.info("KV cache: %d blocks x %d tokens (%.1f MiB); swap: %d blocks", self.num_blocks, self.block_size,
                 self.num_blocks * self.block_bytes / 2**20, self.num_host_blocks)

    # -- sizing ---------------------------------------------------------------------------------
    def kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        m = self.model
        return (m.num_layers, 2, num_blocks, self.block_size, m.num_kv_heads, m.head_dim)

    @property
    def block_bytes(self) -> int:
        m = self.model
        return m.num_layers * 2 * self.block_size * m.num_kv_heads * m.head_dim * self.dtype.itemsize

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks is not None:
            return cache.num_gpu_blocks
        if cache.kv_cache_memory is not None:
            return cache.kv_cache_memory // self.block_bytes
        if self.device.type != "cuda":
            return CPU_DEFAULT_KV_BYTES // self.block_bytes
        # GPU: what gpu_memory_utilization leaves after the weights and a profiled activation peak
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        peak = torch.cuda.max_memory_allocated(self.device)
        total = torch.cuda.get_device_properties(self.device).total_memory
        free_for_kv = total * cache.gpu_memory_utilization - peak
        return max(0, int(free_for_kv // self.block_bytes))

    def _profile_run(self) -> None:
        sched = self.config.scheduler
        num_tokens = min(sched.max_num_batched_tokens or 2048, self.max_model_len)
        blocks = math.ceil(num_tokens / self.block_size)
        kv = torch.zeros(self.kv_shape(blocks), dtype=self.dtype, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=self.device)[None],
            query_start_loc_cpu=[0, num_tokens], seq_lens_cpu=[num_tokens],
            max_query_len=num_tokens, max_seq_len=num_tokens,
        )
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            hidden = self.model(ids, torch.arange(num_tokens, device=self.device), kv, meta)
            self.model.compute_logits(hidden[-min(num_tokens, sched.max_num_seqs):])
        del kv, hidden

    # -- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        self._swap(out)
        if not out.scheduled:
            return StepResult({}, {})
        ids, positions, slots, starts, seq_lens, tables = [], [], [], [0], [], []
        sample_rows: list[int] = []  # flat row of the last token of each request that samples
        sample_reqs: list[Request] = []
        prompt_rows: dict[str, tuple[int, int, int]] = {}  # id -> (first row, count, first position)
        for sr in out.scheduled:
            req, start, n = sr.request, sr.request.num_computed_tokens, sr.num_new_tokens
            tokens = req.all_token_ids
            row0 = len(ids)
            ids.extend(tokens[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend(sr.block_ids[p // self.block_size] * self.block_size + p % self.block_size
                         for p in range(start, start + n))
            starts.append(len(ids))
            seq_lens.append(start + n)
            tables.append(sr.block_ids)
            if start + n == req.num_tokens:
                sample_rows.append(len(ids) - 1)
                sample_reqs.append(req)
            if req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens:
                count = min(start + n, req.num_prompt_tokens - 1) - start  # positions predicting a prompt token
                if count > 0:
                    prompt_rows[req.request_id] = (row0, count, start)
        meta = self._metadata(slots, starts, seq_lens, tables)
        dev = self.device
        hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), self.kv_cache, meta)
        result = StepResult({}, {})
        if sample_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
            for req, sample in zip(sample_reqs, self.sampler(logits, sample_reqs), strict=True):
                result.sampled[req.request_id] = sample
        for rid, (row0, count, pos0) in prompt_rows.items():
            req = next(sr.request for sr in out.scheduled if sr.request.request_id == rid)
            logits = self.model.compute_logits(hidden[row0:row0 + count])
            targets = req.prompt_token_ids[pos0 + 1:pos0 + 1 + count]
            k = req.sampling_params.prompt_logprobs
            result.prompt_logprobs[rid] = (pos0, [to_position_logprobs(d) for d in prompt_logprobs(logits, targets, k)])
        return result

    def _metadata(self, slots, starts, seq_lens, tables) -> AttentionMetadata:
        dev = self.device
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
            max_query_len=max(b - a for a, b in zip(starts, starts[1:], strict=False)),
            max_seq_len=max(seq_lens),
        )

    def _swap(self, out: SchedulerOutput) -> None:
        # swap-outs first: a block freed by a swap-out may be reused by a swap-in of the same step
        if out.swap_out:
            dev_ids, host_ids = zip(*out.swap_out, strict=True)
            self.host_cache[:, :, list(host_ids)] = self.kv_cache[:, :, list(dev_ids)].to("cpu")
        if out.swap_in:
            host_ids, dev_ids = zip(*out.swap_in, strict=True)
            self.kv_cache[:, :, list(dev_ids)] = self.host_cache[:, :, list(host_ids)].to(self.device)

    def free_request(self, request_id: str) -> None:
        self.sampler.free(request_id)


def to_position_logprobs(entry: dict[int, float]) -> PositionLogprobs:
    return {tok: Logprob(lp) for tok, lp in sorted(entry.items(), key=lambda kv: -kv[1])}


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
