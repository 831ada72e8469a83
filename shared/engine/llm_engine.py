"""The text-level engine behind the offline API: tokenization, chat templates, ``n`` fan-out,
beam search and detokenized ``RequestOutput`` objects on top of one ``EngineCore``."""

import dataclasses
import itertools
import logging
from collections.abc import Iterator, Sequence

from kvrelay.shared.config.engine import EngineConfig
from kvrelay.shared.engine.engine_core import EngineCore
from kvrelay.shared.engine.output_processor import OutputProcessor
from kvrelay.shared.engine.outputs import RequestOutput
from kvrelay.shared.wire.sampling_params import SamplingParams

log = logging.getLogger(__name__)

PromptType = str | dict


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from kvrelay.shared.text.tokenizer import eos_token_ids, has_tokenizer, load_tokenizer

        self.config = config
        self.core = EngineCore(config)
        self.tokenizer = None
        self.eos_ids: list[int] = []
        model_dir = None if config.model.load_format == "dummy" else config.model.model
        tok_path = config.model.tokenizer or model_dir
        if tok_path is not None and has_tokenizer(tok_path):
            self.tokenizer = load_tokenizer(tok_path)
        # a checkpoint without tokenizer files still serves token ids (tests, benchmarks)
        self.eos_ids = eos_token_ids(self.tokenizer, self.core.runner.hf_config, model_dir)
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    # -- requests -------------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError("prompt must be a string or {'prompt_token_ids': [...]}")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (dummy weights): pass prompt_token_ids")
        return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def add_request(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> str:
        """Validates everything before touching the engine: a bad request leaves no trace."""
        if priority and self.core.config.scheduler.policy != "priority":
            # as vLLM: accepted under first-come-first-served, it would be ignored
            raise ValueError(f"priority {priority} needs scheduling_policy='priority' (this engine's is "
                             f"{self.core.config.scheduler.policy!r})")
        request_id = request_id or str(next(self._ids))
        text, token_ids = self.tokenize(prompt)
        params.validate()
        child_ids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        children = []
        for i, cid in enumerate(child_ids):
            child_params = self._child_params(params, i)
            eos = self.eos_ids[0] if self.eos_ids else None
            children.append(self.core.make_request(cid, token_ids, child_params, eos, priority, cache_salt))
        if children[0].grammar is not None:
            # the offline API checks a constraint before anything runs, like every other parameter: the
            # compile (on the engine's compile thread, shared by the children) raises its ValueError here
            children[0].grammar.compiled.result()
        self.processor.add(request_id, text, token_ids, params, child_ids)
        for child in children:
            self.core.add_request(child)
        return request_id

    def _child_params(self, params: SamplingParams, index: int) -> SamplingParams:
        extra_stops = [] if params.ignore_eos else [t for t in self.eos_ids[1:] if t not in params.stop_token_ids]
        seed = None if params.seed is None else params.seed + index
        return dataclasses.replace(params, n=1, seed=seed, use_beam_search=False,
                                   stop_token_ids=params.stop_token_ids + extra_stops)

    def shutdown(self) -> None:
        self.core.shutdown()

    def abort(self, request_id: str) -> None:
        self.core.abort(self.processor.abort(request_id))

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self, delta: bool = False) -> list[RequestOutput]:
        outputs, to_stop = self.processor.process(self.core.step(), delta=delta)
        for child in to_stop:
            self.core.finish(child)
        return outputs

    # -- batch helpers --------------------------------------------------------------------------
    def generate(self, prompts: Sequence[PromptType], params: SamplingParams | Sequence[SamplingParams],
                 use_tqdm: bool = False, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        ids = self._add_all(prompts, params, priority)
        done: dict[str, RequestOutput] = {}
        bar = _progress(len(ids), use_tqdm)
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1) if bar else None
        bar.close() if bar else None
        return [done[i] for i in ids]

    def generate_stream(self, prompts: Sequence[PromptType], params: SamplingParams | Sequence[SamplingParams]
                        ) -> Iterator[RequestOutput]:
        ids = self._add_all(prompts, params)
        try:
            while self.has_unfinished():
                yield from self.step(delta=True)
        finally:  # a consumer that stops early must not leave its requests holding KV
            for rid in ids:
                self.abort(rid)

    def _add_all(self, prompts, params, priority: Sequence[int] | None = None) -> list[str]:
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priorities)} priorities")
        if any(p.use_beam_search for p in params_list):
            raise ValueError("use_beam_search requests go through LLM.generate, which runs beam_search")
        base = next(self._ids)
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
                ids.append(self.add_request(prompt, p, request_id=f"batch{base}-{i}", priority=priorities[i]))
        except ValueError:
            for rid in ids:  # all-or-nothing: one bad prompt rejects the batch before any work starts
                self.abort(rid)
            raise
        return ids

    def apply_chat_template(self, messages: list[dict]) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        if not messages:
            raise ValueError("messages must not be empty")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="req")
