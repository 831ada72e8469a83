"""What a request leaves out, against the real gateway, real Redis and the fake worker: the model's
generation_config.json gives the sampling defaults (vLLM's --generation-config auto) and its
max_new_tokens bounds a chat reply that names no max_tokens; --generation-config vllm ignores the file;
--max-tokens-default bounds such a reply where the model does not. What the request sets always wins."""

import json

import openai
import pytest

from tests.integration.gateway_harness import MAX_MODEL_LEN, MODEL, running_stack

pytestmark = pytest.mark.timeout(120)
HI = [{"role": "user", "content": "hi"}]
GENERATION_CONFIG = {"temperature": 0.25, "top_p": 0.5, "top_k": 7, "min_p": 0.05, "repetition_penalty": 1.1,
                     "max_new_tokens": 9, "do_sample": True, "eos_token_id": 2}


def _job(stack, response_id: str):
    (job,) = stack.jobs_for(response_id.split("-", 1)[1])
    return job


@pytest.fixture(params=["auto", "vllm"])
def stack(request, tmp_path):
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    with running_stack(tmp_path, generation_config=request.param, max_tokens_default=5) as s:
        yield request.param, s


def test_defaults_come_from_the_models_generation_config_unless_vllm(stack):
    mode, stack = stack
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    sampling = _job(stack, client.chat.completions.create(model=MODEL, messages=HI).id).sampling
    if mode == "auto":
        expected = {k: v for k, v in GENERATION_CONFIG.items() if k in ("temperature", "top_p", "top_k", "min_p",
                                                                          "repetition_penalty")}
        assert {k: getattr(sampling, k) for k in expected} == expected
        assert sampling.max_tokens == 5  # --max-tokens-default is below the model's max_new_tokens (9)
    else:
        assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p,
                sampling.repetition_penalty) == (1.0, 1.0, -1, 0.0, 1.0)
        assert sampling.max_tokens == 5
    # what the request sets wins
    given = _job(stack, client.chat.completions.create(model=MODEL, messages=HI, temperature=0, max_tokens=40,
                                                         top_p=0.9).id).sampling
    assert (given.temperature, given.top_p, given.max_tokens) == (0.0, 0.9, 40)
    assert given.top_k == (7 if mode == "auto" else -1)
    # completions keep OpenAI's 16 tokens when none is named
    assert _job(stack, client.completions.create(model=MODEL, prompt="hi").id).sampling.max_tokens == 16


def test_max_new_tokens_bounds_a_chat_reply_below_the_server_default(tmp_path):
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    with running_stack(tmp_path, max_tokens_default=64) as stack:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
        assert _job(stack, client.chat.completions.create(model=MODEL, messages=HI).id).sampling.max_tokens == 9
    with running_stack(tmp_path, max_tokens_default=0, generation_config="vllm") as stack:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
        job = _job(stack, client.chat.completions.create(model=MODEL, messages=HI).id)
        assert job.sampling.max_tokens == MAX_MODEL_LEN - len(job.prompt_token_ids)  # 0: as vLLM
