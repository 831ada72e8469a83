"""gateway/api/choice.py's ordering of token events: duplicates behind the expected index are trimmed, but a
worker's error verdict behind it still ends the choice. A job dead-lettered by the worker that restarted
after a crash is answered with an error as of output index 0, after the client had tokens: dropped as a
duplicate, it left the client waiting until the request's deadline."""

from types import SimpleNamespace

import pytest

from kvrelay.gateway.api.choice import ChoiceState
from kvrelay.shared.wire.protocol import TokenEvent
from kvrelay.shared.wire.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return SimpleNamespace(hf=AutoTokenizer.from_pretrained(smollm2_dir))


def _choice(tokenizer) -> ChoiceState:
    return ChoiceState(index=0, job_id="j-0", prompt_index=0, prompt_token_ids=[1, 2, 3],
                       params=SamplingParams(max_tokens=16), tokenizer=tokenizer)


def test_an_error_as_of_index_0_after_tokens_ends_the_choice(tokenizer):
    choice = _choice(tokenizer)
    assert choice.receive(TokenEvent("j-0", token_ids=[504, 505, 506], output_index=0)).token_ids == [504, 505, 506]
    delta = choice.receive(TokenEvent("j-0", finish_reason="error", error="request failed repeatedly",
                                      output_index=0))
    assert delta is not None and delta.finish_reason == "error"
    assert choice.finished and choice.error == "request failed repeatedly"
    assert choice.token_ids == [504, 505, 506]


def test_a_duplicate_behind_the_index_is_still_trimmed(tokenizer):
    choice = _choice(tokenizer)
    choice.receive(TokenEvent("j-0", token_ids=[504, 505], output_index=0))
    assert choice.receive(TokenEvent("j-0", token_ids=[504], output_index=0)) is None
    delta = choice.receive(TokenEvent("j-0", token_ids=[504, 505, 506], output_index=0, finish_reason="length"))
    assert delta.token_ids == [506] and delta.finish_reason == "length"
    assert choice.token_ids == [504, 505, 506]


def test_a_replay_that_diverges_ends_the_choice_with_an_error(tokenizer):
    """A unified worker restarted after a crash re-runs an unfinished job from its start; sampled without a
    seed it may pick other tokens. Trimming the overlap would splice two different texts together."""
    choice = _choice(tokenizer)
    choice.receive(TokenEvent("j-0", token_ids=[504, 505], output_index=0))
    delta = choice.receive(TokenEvent("j-0", token_ids=[504, 999, 506], output_index=0))
    assert delta is not None and delta.finish_reason == "error" and "different text" in choice.error
    assert choice.token_ids == [504, 505]
