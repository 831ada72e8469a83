"""A request whose model is swapped to another version while it is being prepared (tokenizer load, prompt
encoding: seconds under load) is prepared again for the version now served, from the body as the client
sent it, instead of being queued to the version being drained (where no worker would ever take it)."""

import asyncio

from kvrelay.gateway.api.prompts import PREPARE_ATTEMPTS, Prepared, _on_the_served_version
from kvrelay.gateway.api.schemas import CompletionRequest
from kvrelay.gateway.control.model_registry import MODEL_REGISTRY
from kvrelay.shared.wire.protocol import ModelInfo, ModelSpec
from kvrelay.shared.wire.sampling_params import SamplingParams


class Registry:
    def __init__(self, version: int):
        self.spec = ModelSpec(name="chat", version=version)

    async def specs(self) -> dict[str, ModelSpec]:
        return {"chat": self.spec}


def prepare_with(registry: Registry, swaps: list[int]):
    """A prepare that reads the version served when it starts and, like a slow tokenizer load, lets the
    next swap in ``swaps`` happen before it finishes; it applies a default to the body, as the real one does."""
    calls = []

    async def prepare(body: CompletionRequest) -> Prepared:
        version = registry.spec.version
        calls.append((version, body.temperature, "temperature" in body.model_fields_set))
        body.temperature = 0.5 * version  # a per-version default
        if swaps:
            registry.spec = ModelSpec(name="chat", version=swaps.pop(0))
        model = ModelInfo(name=f"chat@{version}", path=f"/repo/chat/{version}", max_model_len=64, vocab_size=8,
                          eos_token_ids=[2], block_size=8, dtype="float32", served_name="chat", version=version)
        return Prepared(model=model, tokenizer=None, prompts=[[1]], params=SamplingParams(), tenant="t", priority=0,
                        cache_salt=None, served_name="chat")

    return prepare, calls


def run(registry: Registry, swaps: list[int]):
    prepare, calls = prepare_with(registry, swaps)
    def parse_body() -> CompletionRequest:
        return CompletionRequest(model="chat", prompt="hi")

    prepared, used = asyncio.run(_on_the_served_version({MODEL_REGISTRY: registry}, parse_body, prepare))
    return prepared, used, calls


def test_no_swap_prepares_once_on_the_body_itself():
    prepared, used, calls = run(Registry(1), [])
    assert prepared.model.name == "chat@1" and len(calls) == 1 and used.temperature == 0.5


def test_a_swap_meanwhile_prepares_again_for_the_new_version_from_the_body_as_sent():
    prepared, used, calls = run(Registry(1), [2])
    assert prepared.model.name == "chat@2"
    assert calls == [(1, 1.0, False), (2, 1.0, False)]  # v1's default did not leak into the second try
    assert used.temperature == 1.0  # the body answered from is the one prepared for v2


def test_it_gives_up_after_a_few_swaps_in_a_row():
    prepared, _, calls = run(Registry(1), list(range(2, 2 + PREPARE_ATTEMPTS)))
    assert len(calls) == PREPARE_ATTEMPTS
