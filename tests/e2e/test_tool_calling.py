"""Tool calling on the real path: a gateway run with --enable-auto-tool-choice --tool-call-parser hermes and a
unified worker serving a tiny model (random weights, SmolLM2's tokenizer), through the openai SDK. Its output
cannot be steered, so these tests check what the server controls: the request is accepted, the chat template
offers the tools and renders calls and results in the history, ``tool_choice: "none"`` leaves the reply
untouched, and a streamed reply says what the whole one says. The parsing of known replies is tested with
a worker stand-in (tests/integration/test_gateway_tools.py) and as units (tests/unit/test_tool_parsers.py).

Two models: the tiny one with a hermes-style template that renders tools (as Qwen2.5's does), and the same
with SmolLM2's own template, which renders none: that one answers a clear 400."""

import shutil

import httpx
import openai
import pytest

from kvrelay.shared.wire.redis_conn import EmbeddedRedis
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import TINY_ENGINE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
MODEL = "tiny"  # TINY_ENGINE's --served-model-name
FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
# What Qwen2.5's template does, in brief: tools in a system block, calls as <tool_call> JSON, results as
# <tool_response> in a user turn (pairing a result with its call by order, not by tool_call_id).
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = [
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 12}


def _serve(model_dir, log_dir):
    with EmbeddedRedis() as redis_url:
        cluster = Cluster(redis_url, str(model_dir), TINY_ENGINE, log_dir)
        cluster.start_gateway(extra=FLAGS)
        cluster.start_worker("unified", "u1")
        try:
            cluster.wait_ready(timeout=300)
            yield openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=120)
        finally:
            cluster.stop()


@pytest.fixture(scope="module")
def hermes(tiny_model_dir, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("hermes-model") / "tiny"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    yield from _serve(model_dir, tmp_path_factory.mktemp("hermes-logs"))


@pytest.fixture(scope="module")
def smollm2_template(tiny_model_dir, tmp_path_factory):
    yield from _serve(tiny_model_dir, tmp_path_factory.mktemp("smollm2-logs"))


def test_a_template_that_renders_tools_offers_them(hermes):
    plain = hermes.chat.completions.create(messages=ASK, **GREEDY)
    auto = hermes.chat.completions.create(messages=ASK, tools=[WEATHER], **GREEDY)
    described = {"type": "function", "function": {**WEATHER["function"],
                                                  "description": "The current weather in a city, in great detail"}}
    longer = hermes.chat.completions.create(messages=ASK, tools=[described], **GREEDY)
    # the tools reach the prompt, description and all
    assert plain.usage.prompt_tokens < auto.usage.prompt_tokens < longer.usage.prompt_tokens
    (choice,) = auto.choices
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.message.tool_calls:  # random weights rarely write a call; one they do write is well formed
        assert choice.finish_reason == "tool_calls"
        assert all(c.id.startswith("call_") and c.function.name for c in choice.message.tool_calls)
    else:
        assert "<tool_call>" not in (choice.message.content or "") or "</tool_call>" in choice.message.content


def test_tool_choice_none_offers_nothing_and_parses_nothing(hermes):
    plain = hermes.chat.completions.create(messages=ASK, **GREEDY)
    none = hermes.chat.completions.create(messages=ASK, tools=[WEATHER], tool_choice="none", **GREEDY)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert not none.choices[0].message.tool_calls and none.choices[0].finish_reason == plain.choices[0].finish_reason


def test_a_streamed_reply_says_what_the_whole_one_says(hermes):
    whole = hermes.chat.completions.create(messages=ASK, tools=[WEATHER], **GREEDY).choices[0]
    content, names, finish = "", [], None
    for chunk in hermes.chat.completions.create(messages=ASK, tools=[WEATHER], stream=True, **GREEDY):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            names += [tc.function.name for tc in choice.delta.tool_calls or [] if tc.id]
            finish = choice.finish_reason or finish
    assert (content or None) == (whole.message.content or None)
    assert names == [c.function.name for c in whole.message.tool_calls or []]
    assert finish == whole.finish_reason


def test_history_with_calls_and_results_renders(hermes):
    before = hermes.chat.completions.create(messages=ASK, tools=[WEATHER], **GREEDY)
    after = hermes.chat.completions.create(messages=HISTORY, tools=[WEATHER], **GREEDY)
    assert after.usage.prompt_tokens > before.usage.prompt_tokens
    # the template got the call's arguments as an object, rendered once (not a JSON string inside JSON)
    root = hermes.base_url.copy_with(path="/")
    with httpx.Client(base_url=str(root), timeout=60) as http:
        ids = http.post("tokenize", json={"model": MODEL, "messages": HISTORY}).json()["tokens"]
        prompt = http.post("detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    # the same history without its call and result is a shorter prompt: both were rendered
    without = hermes.chat.completions.create(messages=[*ASK, {"role": "assistant", "content": "Checking."}],
                                             tools=[WEATHER], **GREEDY)
    assert after.usage.prompt_tokens > without.usage.prompt_tokens


def test_smollm2s_template_renders_no_tools_a_400(smollm2_template):
    client = smollm2_template
    for body, param in (({"messages": ASK, "tools": [WEATHER]}, "tools"),
                        ({"messages": HISTORY}, "messages.1.tool_calls")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**body, **GREEDY)
        error = info.value.body
        assert error["param"] == param and "does not render tools" in error["message"], error
        assert "dict object" not in error["message"]
    # tools offered to nobody are fine
    out = client.chat.completions.create(messages=ASK, tools=[WEATHER], tool_choice="none", **GREEDY)
    assert out.choices[0].message.content is not None
