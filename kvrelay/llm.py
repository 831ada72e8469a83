"""``LLM``: the offline API in vLLM's shape, a thin wrapper over ``shared.llm_engine.LLMEngine``."""

from collections.abc import Iterator, Sequence

from pydantic import ValidationError

from kvrelay.shared.config.auto_device import auto_device
from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvrelay.shared.config.flags import flag_error, flags_of
from kvrelay.shared.config.offline_step import offline_batched_tokens
from kvrelay.shared.engine.beam_search import beam_search
from kvrelay.shared.engine.llm_engine import LLMEngine, PromptType
from kvrelay.shared.engine.outputs import RequestOutput
from kvrelay.shared.repo.model_source import resolve_model
from kvrelay.shared.wire.sampling_params import SamplingParams

ENGINE_FLAGS = flags_of(EngineConfig)


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        swap_space: float = 0.0,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        max_prefill_tokens_with_decodes: int = 512,
        target_step_ms: float = 0.0,
        block_size: int = 16,
        kv_cache_memory: int | None = None,
        num_gpu_blocks: int | None = None,
        load_format: str = "auto",
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        calculate_kv_scales: bool = False,
        tokenizer: str | None = None,
        device: str = "auto",
        seed: int = 0,
        scheduling_policy: str = "fcfs",
        enforce_eager: bool = False,
        cudagraph_mode: str = "FULL_AND_PIECEWISE",
        async_scheduling: bool | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        pipeline_batch_queue: bool = False,
    ):
        resolved = resolve_model(model, load_format)
        if max_num_batched_tokens is None and enable_chunked_prefill:
            max_num_batched_tokens = offline_batched_tokens(auto_device() if device == "auto" else device)
        try:
            config = EngineConfig(
                model=ModelConfig(model=resolved.path, dtype=dtype, max_model_len=max_model_len,
                                  load_format=resolved.load_format, quantization=quantization,
                                  tokenizer=tokenizer, seed=seed,
                                  served_model_name=resolved.served_name, enforce_eager=enforce_eager,
                                  cudagraph_mode=cudagraph_mode),
                cache=CacheConfig(block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
                                  kv_cache_memory=kv_cache_memory, num_gpu_blocks=num_gpu_blocks,
                                  swap_space=swap_space, enable_prefix_caching=enable_prefix_caching,
                                  kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=calculate_kv_scales),
                scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                          max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes,
                                          target_step_ms=target_step_ms,
                                          enable_chunked_prefill=enable_chunked_prefill, policy=scheduling_policy),
                device=device, async_scheduling=async_scheduling, tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size, pipeline_batch_queue=pipeline_batch_queue)
        except ValidationError as exc:  # one line naming the setting, before anything loads
            raise flag_error(exc, ENGINE_FLAGS) from None
        self.engine = LLMEngine(config)

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel ranks (processes); the LLM cannot generate afterwards."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """``priority`` (lower runs first) takes effect with ``scheduling_policy="priority"``."""
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams) and params.use_beam_search:
            return beam_search(self.engine, [prompts] if isinstance(prompts, str | dict) else prompts, params)
        return self.engine.generate([prompts] if isinstance(prompts, str | dict) else prompts, params, use_tqdm,
                                    priority)

    def generate_stream(self, prompts: PromptType | Sequence[PromptType],
                        sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        return self.engine.generate_stream([prompts] if isinstance(prompts, str | dict) else prompts,
                                           sampling_params or SamplingParams())

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            text = self.engine.apply_chat_template(conv)
            prompts.append({"prompt": text, "prompt_token_ids": self.engine.tokenize(text, add_special_tokens=False)[1]})
        return self.generate(prompts, sampling_params, use_tqdm)
