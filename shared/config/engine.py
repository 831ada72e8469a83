"""Engine configuration as dataclasses; field names follow vLLM's CLI flags (``--max-num-seqs`` is
``max_num_seqs``). Importing it needs no torch: the gateway's CLI shares the parser."""

import dataclasses
from dataclasses import field
from typing import TYPE_CHECKING, Literal

from pydantic.dataclasses import dataclass

from kvrelay.shared.config import depends
from kvrelay.shared.config.auto_device import auto_device
from kvrelay.shared.config.declare import CONFIG, Device, DType, ExistingDir, ModelName, PowerOfTwo, setting

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "float16", "bfloat16")
DEFAULT_STEP_TOKENS = 2048  # a step's token budget under chunked prefill where --max-num-batched-tokens is unset
# FULL_AND_PIECEWISE's largest bucket: past it a step's GPU work outweighs launching it eagerly, and each bucket adds
# a graph per layer and its share of capture time, so larger steps run eagerly (shared/engine/piecewise_graphs.py)
PIECEWISE_MAX_TOKENS = 2048
# the worker roles whose requests decode (shared/config/role_settings.py): a prefill worker's end at their first
# token, so a setting of decode steps is refused there; the offline LLM API has no role and takes every setting
DECODING = ("decode", "unified")


@dataclass(config=CONFIG)
class ModelConfig:
    model: ModelName = setting(help="HF model directory, .gguf file, 'smollm2' (default) or dummy:<preset> "
                              "(e.g. dummy:llama-3-8b)")
    dtype: DType = setting("auto", "weights and activations (auto: float32 on CPU, bfloat16 on CUDA)")
    max_model_len: int | None = setting(None, "longest sequence, prompt and output (default: the model's own)",
                                        ge=1)
    load_format: Literal["auto", "dummy"] = setting("auto", "dummy: random weights of the model's shape")
    # vLLM's flag and names; a checkpoint's config.json quantization_config sets it when left unset
    quantization: Literal["fp8", "int8", "awq", "gptq"] | None = setting(
        None, "weights: fp8 or int8 (quantized as they load, or an FP8 checkpoint), awq or gptq (4-bit "
              "checkpoints) (default: the checkpoint's own quantization_config)")
    tokenizer: ExistingDir | None = setting(None, "tokenizer directory (default: the model's)")
    seed: int = setting(0, "seed of the sampler's generator and of dummy weights")
    served_model_name: str | None = setting(None, "the name clients use (default: from --model)")
    enforce_eager: bool = setting(False, "CUDA: run decode eagerly, without CUDA graphs (debugging, comparisons); "
                                  "refused on the CPU, which runs every step eagerly")
    # vLLM's flag, names and default (its compilation config's cudagraph_mode); --enforce-eager is NONE. Pieces are
    # the default because a step holding prompt tokens launched eagerly costs more host time than its GPU work,
    # and the decodes riding in it wait for that (BENCHMARKS.md: unified mode's inter-token latency).
    cudagraph_mode: Literal["NONE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"] = setting(
        "FULL_AND_PIECEWISE", "CUDA: which steps replay CUDA graphs. FULL_AND_PIECEWISE: decode-only steps whole, "
        "and steps holding prompt tokens in pieces per token-count bucket with attention run eagerly between them "
        "(Llama-family models on one GPU; any other model keeps FULL_DECODE_ONLY, said in the log); "
        "FULL_DECODE_ONLY: decode-only steps only; NONE: no graphs (as --enforce-eager). Refused on the CPU")

    @property
    def graph_mode(self) -> str:
        """The cudagraph mode in force: NONE under --enforce-eager."""
        return "NONE" if self.enforce_eager else self.cudagraph_mode

    def torch_dtype(self, device: str) -> "torch.dtype":
        return resolve_dtype(self.dtype, device)


def resolve_dtype(dtype: str, device: str) -> "torch.dtype":
    """``--dtype`` on a device of type ``device`` ("cpu", "cuda")."""
    import torch

    if dtype == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    return getattr(torch, dtype)


@dataclass(config=CONFIG)
class CacheConfig:
    block_size: PowerOfTwo = setting(16, "tokens per KV cache block")
    gpu_memory_utilization: float = setting(0.9, "CUDA: fraction of device memory for weights + KV cache "
                                            "(refused on the CPU: --kv-cache-memory sizes its KV cache)", gt=0, le=1)
    kv_cache_memory: int | None = setting(None, "bytes of KV cache (CPU default: 1 GiB)", ge=1)
    # "gpu" = the device cache, as in vLLM
    num_gpu_blocks: int | None = setting(None, "KV blocks instead of both of the above (refused beside "
                                         "--kv-cache-memory, and on a worker of several models, which share one pool "
                                         "of --kv-cache-memory bytes)", flag="--num-gpu-blocks-override", ge=1)
    swap_space: float = setting(0.0, "GiB of host memory for preempted requests' KV (0: preempt by recompute)",
                                ge=0)
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of a prompt's already computed prefix")
    # vLLM's flag and names: fp8 is fp8_e4m3 (float8_e4m3fn, one fixed float32 scale per layer for K and
    # one for V: shared/engine/kv_dtype.py says which and why, shared/engine/kv_scales.py reads them)
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = setting(
        "auto", "KV cache storage: auto (the model's dtype) or fp8 (= fp8_e4m3: half the bytes of bf16, "
                "twice the blocks in the same memory; per-layer K/V scales from the checkpoint, else 1.0)")
    # vLLM's flag: amax of one calibration batch's keys / values per layer, then fixed
    # (shared/engine/kv_calibration.py says which batch, which constants and why). As the batch queue is for the
    # models that pipeline, it is for a worker's models whose KV is fp8: a models file may mix fp8 and unscaled
    # caches, and a flag that refused the mix would leave no way to calculate the scales of the fp8 ones.
    calculate_kv_scales: bool = setting(
        False, "fp8 KV cache: compute each layer's K and V scale from a fixed calibration batch run at start "
               "(amax / 200 for K, amax / 100 for V, as vLLM), before any request, then keep them; they replace "
               "the scales an FP8 checkpoint carries, as in vLLM. For every model of the worker whose KV cache is "
               "fp8 (--kv-cache-dtype fp8, or a --config model's own kv_cache_dtype) and not for those of an "
               "unscaled cache (auto), which run without it; a --config model may set its own calculate_kv_scales; "
               "refused where no model's KV cache is fp8 (a worker of a model repository alone takes it for the "
               "models it loads later), and beside tensor or pipeline parallelism")


@dataclass(config=CONFIG)
class SchedulerConfig:
    max_num_seqs: int = setting(256, "requests in the running batch at most", ge=1)
    max_num_batched_tokens: int | None = setting(
        None, "tokens per step at most (default: 2048 with chunked prefill, else --max-model-len)", ge=1)
    enable_chunked_prefill: bool = setting(True, "split long prompts across steps, mixed with decodes")
    # Sarathi-Serve's stall-free batching. Not vLLM's --long-prefill-token-threshold, which caps every
    # request's chunk whether or not anything decodes (a lone prompt would take more steps than it needs);
    # this caps the step's prefill tokens only while they would delay decodes. Why 512: a decode row costs
    # little (the step's weight reads are paid once for all rows), a prefill token about a decode row of
    # compute, so a step's time grows with its prefill tokens. An 8B model on an H200 reads its weights in
    # ~3-4 ms and computes ~15-25 us per token: 512 prefill tokens make a step of ~12-16 ms, under a 25 ms
    # inter-token SLO, where a full 2048-token chunk makes ~37 ms; and 512 per step still prefills ~30k
    # tokens/s beside the decodes.
    max_prefill_tokens_with_decodes: int = setting(
        512, "prompt tokens per step at most while requests decode, so decodes never wait behind a whole "
             "chunk (with nothing decoding a step takes --max-num-batched-tokens; 0: no cap; needs chunked "
             "prefill: refused with --no-enable-chunked-prefill). Each prompt token costs about a decode row of "
             "compute: 512 keep an 8B model's step on an H200 near 15 ms, where a 2048-token chunk takes ~37 ms",
        ge=0, roles=DECODING)
    # Sarathi-Serve derives the prompt-token budget from the inter-token SLO by profiling; a fixed count cannot
    # know what a step costs on this GPU, model and batch. This fits step time to decode rows, their context
    # and prompt tokens from the engine's own steps (shared/engine/step_cost.py) and caps each step's prompt
    # tokens to what the target leaves, at most --max-prefill-tokens-with-decodes (0 there: the step's whole
    # budget). Off by default until GPU runs show it meets the inter-token SLO where the fixed cap does not
    # (bench/h200_prefill_budget.sh): it changes every step's shape, and its fit has been checked on the CPU only.
    # The prediction is of a typical step, and steps scatter around it, so a p99 SLO wants a target below it.
    target_step_ms: float = setting(
        0.0, "while requests decode, cap a step's prompt tokens so that its duration, predicted from this "
             "engine's measured steps, stays within this many ms (a typical step: set it below a p99 inter-token "
             "SLO, e.g. 20 for 25; at least one KV block of prompt tokens a step, "
             "at most --max-prefill-tokens-with-decodes, or --max-num-batched-tokens where that is 0; needs chunked "
             "prefill; 0: off, the fixed cap alone, the default until GPU runs show it beats that cap)",
        ge=0, roles=DECODING)
    policy: Literal["fcfs", "priority"] = setting("fcfs", "admission order (priority: lower value first, then "
                                                  "arrival)", flag="--scheduling-policy")
    # On by default: with one tenant it orders exactly like the plain policy, so only multi-tenant traffic
    # sees a difference (shared/engine/fair_queue.py).
    tenant_fairness: bool = setting(True, "admit between tenants by tokens served, so one tenant's flood "
                                    "cannot starve another")
    tenant_kv_quota: float | None = setting(None, "max share of KV blocks one tenant may hold; its further "
                                            "requests wait (default: none)", gt=0, le=1)


@dataclass(config=CONFIG)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: Device = setting("auto", "auto | cpu | cuda[:N] (auto: CUDA when present)")
    # vLLM's flag: sampled ids stay on the device and feed the next step, which is scheduled and launched
    # while this one runs (shared/engine/async_step.py). A prefill step ends at the first token, which the
    # handoff needs at once: nothing to overlap, so a prefill worker refuses it. None (the default, as in
    # vLLM): on for a decoding engine on CUDA (the host's scheduling leaves the step's critical path),
    # off on the CPU, whose host is also the device, so nothing runs while the host schedules.
    async_scheduling: bool | None = setting(None, "schedule and launch the next step while the device runs this "
                                            "one (same outputs; auto: on for CUDA)", roles=DECODING)
    # vLLM's flag: one process per rank, rank 0 schedules and samples (shared/engine/ranks/)
    tensor_parallel_size: int = setting(1, "split each model over this many ranks (processes; one device "
                                        "each on CUDA): heads, MLP and vocabulary sharded", ge=1)
    # vLLM's flag: contiguous layer stages, one rank each; rank 0 holds stage 0 and schedules (shared/engine/ranks/)
    pipeline_parallel_size: int = setting(1, "split each model's layers into this many stages (processes; one "
                                          "device each on CUDA), run one after the other", ge=1)
    # vLLM V1's batch queue: with M stages, up to M micro-batches of disjoint requests in flight across steps,
    # so the pipeline does not drain at every step (shared/engine/batch_queue.py)
    # As vLLM keeps its batch queue wherever there is a pipeline, the flag is for every model of a worker that has
    # one: a models file may mix models of a pipeline with models of one stage, and a flag that refused the mix
    # would leave no way to ask for the queue on all the pipelined ones at once.
    pipeline_batch_queue: bool = setting(False, "with --pipeline-parallel-size M >= 2, keep up to M micro-batches "
                                         "of disjoint requests in flight across steps (same outputs). For every "
                                         "model of the worker that has a pipeline (--pipeline-parallel-size, or a "
                                         "--config model's own pipeline_parallel_size) and not for those of one "
                                         "stage; a --config model may set its own pipeline_batch_queue; refused "
                                         "where no model has a pipeline")

    @property
    def uses_batch_queue(self) -> bool:
        return self.pipeline_batch_queue and self.pipeline_parallel_size > 1

    def memory_knobs(self) -> "MemoryKnobs":
        m, c, s = self.model, self.cache, self.scheduler
        return MemoryKnobs(dtype=m.dtype, quantization=m.quantization, max_model_len=m.max_model_len,
                           graph_mode=m.graph_mode, block_size=c.block_size, kv_cache_dtype=c.kv_cache_dtype,
                           max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                           enable_chunked_prefill=s.enable_chunked_prefill, device=self.device,
                           tensor_parallel_size=self.tensor_parallel_size,
                           pipeline_parallel_size=self.pipeline_parallel_size)

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = auto_device()
        depends.check(self, NEEDS)

    def with_parallel_sizes(self, tensor: int, pipeline: int, batch_queue: bool | None = None) -> "EngineConfig":
        """This engine's settings for a model of its own rank group (a models file's sizes): the batch queue
        where the model has a pipeline to keep filled, or ``batch_queue`` where the model sets its own (True
        without a pipeline is refused, as the flag is)."""
        queue = self.pipeline_batch_queue and pipeline > 1 if batch_queue is None else batch_queue
        return dataclasses.replace(self, tensor_parallel_size=tensor, pipeline_parallel_size=pipeline,
                                   pipeline_batch_queue=queue)


@dataclasses.dataclass(frozen=True)
class MemoryKnobs:
    """The settings that what a model keeps beside its weights and KV, and its step peak, scale with: what a
    worker estimates a model's memory from before loading it (shared/worker/model_overhead.py), so that it
    reads no section of the engine's settings itself."""
    dtype: str  # --dtype as set ("auto" unresolved); torch_dtype() resolves it
    quantization: str | None
    max_model_len: int | None  # None: the model's own
    graph_mode: str  # the cudagraph mode in force (NONE under --enforce-eager)
    block_size: int
    kv_cache_dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int | None  # None: step_tokens() resolves the default
    enable_chunked_prefill: bool
    device: str
    tensor_parallel_size: int
    pipeline_parallel_size: int

    def torch_dtype(self) -> "torch.dtype":
        import torch

        return resolve_dtype(self.dtype, torch.device(self.device).type)

    def step_tokens(self, max_len: int) -> int:
        """The tokens one step may compute, for a model whose longest sequence is ``max_len``."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return DEFAULT_STEP_TOKENS if self.enable_chunked_prefill else max_len

    def piecewise_tokens(self, max_len: int) -> int:
        """The rows FULL_AND_PIECEWISE's static buffers and largest piece hold (0 in any other mode)."""
        return min(self.step_tokens(max_len), PIECEWISE_MAX_TOKENS) if self.graph_mode == "FULL_AND_PIECEWISE" else 0


def _on_cpu(config: EngineConfig) -> str:
    return ("only on a CUDA device (the device here is the CPU: --device cpu, or auto where torch sees no GPU)"
            if config.device == "cpu" else "")


def _kv_scales_inert(config: EngineConfig) -> str:
    if config.cache.kv_cache_dtype == "auto":
        return "only with --kv-cache-dtype fp8 (--kv-cache-dtype auto stores K and V unscaled)"
    if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
        # ranks take their scales from rank 0's table as they start (shared/engine/ranks/rank_config.py), and rank 0
        # alone would see only its own heads or layers of the calibration batch
        return ("not with --tensor-parallel-size or --pipeline-parallel-size above 1 (each rank computes only its "
                "own heads or layers)")
    return ""


# settings that only another setting's value makes take effect (shared/config/depends.py)
NEEDS = (
    depends.Needs(("pipeline_batch_queue",), lambda c: "" if c.pipeline_parallel_size > 1 else
                  "only with --pipeline-parallel-size 2 or more (with 1 there is no pipeline to keep filled)"),
    depends.Needs(("scheduler", "max_prefill_tokens_with_decodes"), lambda c: "" if c.scheduler.enable_chunked_prefill
                  else "only with chunked prefill (--no-enable-chunked-prefill runs each prompt whole, which no cap "
                  "can split)"),
    depends.Needs(("scheduler", "target_step_ms"), lambda c: "" if c.scheduler.enable_chunked_prefill
                  else "only with chunked prefill (--no-enable-chunked-prefill runs each prompt whole, which no "
                  "step-time target can split)"),
    depends.Needs(("cache", "kv_cache_memory"), lambda c: "" if c.cache.num_gpu_blocks is None else
                  "not with --num-gpu-blocks-override, which sets the KV cache's size"),
    depends.Needs(("cache", "calculate_kv_scales"), lambda c: _kv_scales_inert(c)),
    depends.Needs(("model", "enforce_eager"), _on_cpu),
    depends.Needs(("model", "cudagraph_mode"), lambda c: _on_cpu(c) or (
        "not with --enforce-eager, which is --cudagraph-mode NONE"
        if c.model.enforce_eager and c.model.cudagraph_mode != "NONE" else "")),
    depends.Needs(("cache", "gpu_memory_utilization"), _on_cpu),
)
