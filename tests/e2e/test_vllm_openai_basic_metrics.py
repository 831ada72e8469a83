"""vLLM's OpenAI-server cases that need their own server flags, against one ``kvrelay serve`` of SmolLM2 run with
``--max-logprobs -1`` (vLLM's test_chat_echo.py serves with a bound past the vocabulary) and
``--return-tokens-as-token-ids`` (test_return_tokens_as_ids.py's server-flag variant; the request-field variant
is in test_vllm_openai_completion.py): vLLM's test_basic.py, test_metrics.py, test_chat_echo.py and
test_return_tokens_as_ids.py, written anew with the openai SDK as the client. Each test names the vLLM case it
mirrors. Not mirrored: /load (--enable-server-load-tracking: kvrelay has no such route), the multimodal model
and the run_batch entrypoint of test_metrics.py (no images, no batch runner)."""

import asyncio
import time
from importlib import metadata

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.shared.wire.redis_keys import HEARTBEAT_INTERVAL_S
from tests.e2e.vllm_server import MODEL, check_chat_token_ids, check_completion_token_ids, serve_smollm2, tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
LIVENESS_S = 120  # generous: a loaded 2-core box; these bound "eventually", not speed


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    with serve_smollm2(smollm2_dir, tmp_path_factory.mktemp("vllm-basic") / "serve.log", "--max-logprobs", "-1",
                       "--return-tokens-as-token-ids") as pair:
        yield pair


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server[1]


@pytest.fixture(scope="module")
def url(server) -> str:
    return f"http://127.0.0.1:{server[0].port}"


def test_show_version(url):
    """test_basic.py::test_show_version: /version is the installed kvrelay's."""
    resp = httpx.get(f"{url}/version", timeout=10)
    assert resp.status_code == 200 and resp.json() == {"version": metadata.version("kvrelay")}


def test_check_health(url):
    """test_basic.py::test_check_health."""
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_request_wrong_content_type(client):
    """test_basic.py::test_request_wrong_content_type: a form-encoded body is refused."""
    with pytest.raises(openai.APIStatusError) as exc:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Write a long story"}],
                                       max_tokens=10, extra_headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert 400 <= exc.value.status_code < 500


def test_request_cancellation(client, url):
    """test_basic.py::test_request_cancellation: many long requests whose clients give up are aborted (the
    running count drops to 0 having generated less than half of what they asked for, where running on would
    generate all of it: min_tokens), and the server answers afterwards."""
    before = _quiet(url).get("vllm:generation_tokens_total", 0)

    async def give_up() -> list[BaseException | object]:
        impatient = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0, timeout=0.5)
        story = [{"role": "user", "content": "Write a long story"}]
        return await asyncio.gather(*(impatient.chat.completions.create(
            model=MODEL, messages=story, max_tokens=400, extra_body={"min_tokens": 400}) for _ in range(20)),
            return_exceptions=True)

    results = asyncio.run(give_up())
    assert all(isinstance(r, openai.APITimeoutError) for r in results), results
    generated = _quiet(url).get("vllm:generation_tokens_total", 0) - before
    assert generated < 20 * 400 / 2, f"{generated:g} tokens generated for 20 clients that gave up"
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=10)
    assert len(out.choices) == 1


EXPECTED = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:iteration_tokens_total", "vllm:cache_config_info",
    "vllm:request_success_total",
    *(f"vllm:{histogram}_{suffix}" for histogram in (
        "request_prompt_tokens", "request_generation_tokens", "request_params_n", "request_params_max_tokens",
        "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
        "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
        "request_decode_time_seconds") for suffix in ("sum", "bucket", "count")),
]


def test_metrics_exist(client, url):
    """test_metrics.py::test_metrics_exist (the text model; vLLM's hidden deprecated names are not asked)."""
    client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=5, temperature=0.0)
    text = httpx.get(f"{url}/metrics", timeout=10).text
    assert [name for name in EXPECTED if name not in text] == []


def test_metrics_counts(client, url, smollm2_dir):
    """test_metrics.py::test_metrics_counts: requests of 10 tokens each (3 rather than vLLM's 10, for time)
    move every count by what they did (measured as the difference: the module's other tests share the server)."""
    prompt = tokenizer(smollm2_dir).encode("Hello my name is Robert and I love magic")
    requests, max_tokens, p = 3, 10, len(prompt)
    expected = {
        "vllm:time_to_first_token_seconds_count": requests,
        "vllm:time_per_output_token_seconds_count": requests * (max_tokens - 1),
        "vllm:e2e_request_latency_seconds_count": requests,
        "vllm:request_queue_time_seconds_count": requests,
        "vllm:request_inference_time_seconds_count": requests,
        "vllm:request_prefill_time_seconds_count": requests,
        "vllm:request_decode_time_seconds_count": requests,
        "vllm:request_prompt_tokens_sum": requests * p, "vllm:request_prompt_tokens_count": requests,
        "vllm:request_generation_tokens_sum": requests * max_tokens,
        "vllm:request_generation_tokens_count": requests,
        "vllm:request_params_n_count": requests,
        "vllm:request_params_max_tokens_sum": requests * max_tokens,
        "vllm:request_params_max_tokens_count": requests,
        "vllm:iteration_tokens_total_sum": requests * (p + max_tokens),
        "vllm:iteration_tokens_total_count": requests * max_tokens,
        "vllm:prompt_tokens_total": requests * p, "vllm:generation_tokens_total": requests * max_tokens,
        "vllm:request_success_total": requests,
    }
    before = _quiet(url)
    for _ in range(requests):  # one at a time, as vLLM's: each engine step holds one request
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, extra_body={"ignore_eos": True})
    after = _wait_for(url, lambda m: m.get("vllm:request_success_total", 0) - before.get("vllm:request_success_total", 0)
                      >= requests and m.get("vllm:iteration_tokens_total_count", 0)
                      - before.get("vllm:iteration_tokens_total_count", 0) >= requests * max_tokens)
    moved = {name: after.get(name, 0) - before.get(name, 0) for name in expected}
    assert moved == expected


def test_abort_metrics_reset(url, client, smollm2_dir):
    """test_metrics.py::test_abort_metrics_reset: running requests show in the gauges and the KV-cache usage,
    and once their clients go, all three are back to 0."""
    prompt = tokenizer(smollm2_dir).encode("Hello my name is Robert and I love magic")
    # the gateway has a model's request gauges from its first request on: none yet reads as none running
    _wait_for(url, lambda m: m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:kv_cache_usage_perc", 0) == 0)

    async def start_then_abort() -> dict[str, float]:
        impatient = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
        tasks = [asyncio.create_task(impatient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=400, temperature=0.0, extra_body={"ignore_eos": True}))
            for _ in range(3)]
        busy = await asyncio.to_thread(_wait_for, url, lambda m: m.get("vllm:num_requests_running", 0) > 0
                                       and m.get("vllm:kv_cache_usage_perc", 0) > 0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return busy

    busy = asyncio.run(start_then_abort())
    assert busy["vllm:num_requests_running"] > 0 and busy["vllm:kv_cache_usage_perc"] > 0
    _wait_for(url, lambda m: m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
              and m["vllm:kv_cache_usage_perc"] == 0)


@pytest.mark.parametrize("echo", [True, False])
def test_chat_session_with_echo_and_continue_final_message(client, echo):
    """test_chat_echo.py::test_chat_session_with_echo_and_continue_final_message: the reply continues the
    final assistant message, and echo puts that message before it."""
    saying = "Here is a common saying about apple. An apple a day, keeps"
    out = client.chat.completions.create(model=MODEL, temperature=0.0, max_tokens=60,
                                         messages=[{"role": "user", "content": "tell me a common saying"},
                                                   {"role": "assistant", "content": saying}],
                                         extra_body={"echo": echo, "continue_final_message": True,
                                                     "add_generation_prompt": False})
    (choice,) = out.choices
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    assert (saying in choice.message.content) == echo


def test_prompt_logprobs_whole_vocabulary(client, url):
    """test_chat_echo.py::test_prompt_logprobs: prompt_logprobs -1 (the whole vocabulary), allowed by
    --max-logprobs -1. Read as plain JSON: the SDK's models take long over a vocabulary per prompt token."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Beijing?"}]
    resp = httpx.post(f"{url}/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {client.api_key}"},
                      json={"model": MODEL, "messages": messages, "max_tokens": 1, "prompt_logprobs": -1})
    assert resp.status_code == 200, resp.text[:500]
    positions = resp.json()["prompt_logprobs"]
    assert len(positions) > 1 and positions[0] is None and all(len(p) == 49152 for p in positions[1:])


def test_top_logprobs_whole_vocabulary(client):
    """test_chat_echo.py::test_top_logprobs: top_logprobs -1 with logprobs on (vLLM's test sends the string
    "true", which kvrelay's strict types refuse as OpenAI does; the boolean here)."""
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Beijing is the capital of which country?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, logprobs=True,
                                         extra_body={"top_logprobs": -1})
    content = out.choices[0].logprobs.content
    assert len(content) > 0 and len(content[0].top_logprobs) >= 49152


def test_completion_return_tokens_as_token_ids_server_flag(client, smollm2_dir):
    """test_return_tokens_as_ids.py::test_completion_return_tokens_as_token_ids_completion, server-flag
    variant: tokens and top_logprobs' keys agree, and their ids decode to the text (an emoji split across
    tokens included)."""
    check_completion_token_ids(client, tokenizer(smollm2_dir), {})


def test_chat_return_tokens_as_token_ids_server_flag(client, smollm2_dir):
    """test_return_tokens_as_ids.py::test_chat_return_tokens_as_token_ids_completion, server-flag variant."""
    check_chat_token_ids(client, tokenizer(smollm2_dir), {})


def _samples(url: str) -> dict[str, float]:
    """Every sample of /metrics by name, summed over labels (one model, one engine here)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_bucket"):
                totals[sample.name] = totals.get(sample.name, 0) + sample.value
    return totals


def _quiet(url: str) -> dict[str, float]:
    """The metrics once the server is idle and they stop moving: the module's earlier tests (aborted streams
    among them) finish their requests, and record them, after their clients have moved on. The engine's series
    are as of each worker's last heartbeat, so only values unchanged across more than two heartbeats are known
    to hold every earlier request (two reads within one beat agree while both are stale)."""
    stable_s = 2 * HEARTBEAT_INTERVAL_S + 0.5
    last, since = None, time.monotonic()
    deadline = since + LIVENESS_S
    while True:
        samples = {name: v for name, v in _samples(url).items() if name.startswith("vllm:")}  # not process_*
        idle = samples.get("vllm:num_requests_running", 0) == 0 and samples.get("vllm:num_requests_waiting", 0) == 0
        now = time.monotonic()
        if not idle or samples != last:
            last, since = (samples if idle else None), now
        elif now - since >= stable_s:
            return samples
        assert now < deadline, f"the server never went quiet: {samples}"
        time.sleep(0.5)


def _wait_for(url: str, done) -> dict[str, float]:
    deadline = time.monotonic() + LIVENESS_S
    while True:
        samples = _samples(url)
        if done(samples):
            return samples
        assert time.monotonic() < deadline, f"metrics never got there: {samples}"
        time.sleep(0.2)
