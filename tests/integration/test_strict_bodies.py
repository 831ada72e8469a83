"""Request bodies are read strictly (gateway/bodies.py ``validate``, gateway/api/schemas.py): no coercion
("2" is not n=2, 1 is not logprobs=true, 5.0 is not an int), in nested models too; ``model: null``,
non-finite numbers (NaN, Infinity, 1e400) and absurd ones (temperature 1e308) are a 400 naming the field
in OpenAI's error shape. What the openai SDK sends stays valid, ints where floats are expected included.

Real Redis, the real gateway app on a real port, a fake worker (gateway_harness.py); the admin API's bodies
through a second gateway that has an admin key."""

import openai
import pytest
import requests

from tests.integration.gateway_harness import MODEL, REPLY, running_stack

pytestmark = pytest.mark.timeout(120)

ADMIN_KEY = "admin-key-0123456789abcdef"
PROMPT = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("strict")) as s:
        yield s


def assert_400(r: requests.Response, param: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    return err


@pytest.mark.parametrize("path,body,param", [
    ("completions", {"stream": "yes"}, "stream"),
    ("completions", {"stream": 1}, "stream"),
    ("completions", {"n": "2"}, "n"),
    ("completions", {"n": 2.0}, "n"),
    ("completions", {"max_tokens": "5"}, "max_tokens"),
    ("completions", {"max_tokens": 5.0}, "max_tokens"),
    ("completions", {"temperature": "0.5"}, "temperature"),
    ("completions", {"temperature": True}, "temperature"),
    ("completions", {"top_p": "1"}, "top_p"),
    ("completions", {"seed": "7"}, "seed"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"ignore_eos": "true"}, "ignore_eos"),
    ("completions", {"ignore_eos": 0}, "ignore_eos"),
    ("completions", {"user": 5}, "user"),
    ("completions", {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ("completions", {"model": None}, "model"),
    ("chat/completions", {"model": None}, "model"),
    ("chat/completions", {"logprobs": 1}, "logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": "2"}, "top_logprobs"),
    ("chat/completions", {"max_completion_tokens": "4"}, "max_completion_tokens"),
    ("chat/completions", {"add_generation_prompt": "no"}, "add_generation_prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages.0.name"),
    ("chat/completions", {"messages": [{"role": 1, "content": "hi"}]}, "messages.0.role"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content"),
])
def test_no_coercion(stack, path, body, param):
    base = PROMPT if path == "completions" else CHAT
    assert_400(requests.post(f"{stack.url}/v1/{path}", json={**base, **body}, timeout=30), param)


@pytest.mark.parametrize("path,body,param", [
    ("tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("tokenize", {"model": None, "prompt": "hi"}, "model"),
    ("detokenize", {"tokens": [1, 2.0]}, "tokens.1"),
])
def test_no_coercion_on_tokenize(stack, path, body, param):
    assert_400(requests.post(f"{stack.url}/{path}", json=body, timeout=30), param)


@pytest.mark.parametrize("field,literal", [
    ("temperature", "NaN"), ("top_p", "Infinity"), ("presence_penalty", "-Infinity"), ("temperature", "1e400"),
    ("frequency_penalty", "-" + "9" * 400 + ".0"),
])
def test_non_finite_numbers_name_their_field(stack, field, literal):
    body = f'{{"model": "{MODEL}", "prompt": "hi", "{field}": {literal}}}'.encode()
    err = assert_400(requests.post(f"{stack.url}/v1/completions", data=body, headers=JSON, timeout=30), field)
    assert "finite" in err["message"]


def test_non_finite_numbers_nested(stack):
    body = b'{"model": "tiny", "prompt": "hi", "logit_bias": {"5": NaN}}'
    assert_400(requests.post(f"{stack.url}/v1/completions", data=body, headers=JSON, timeout=30), "logit_bias.5")
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi", "weight": Infinity}]}'
    assert_400(requests.post(f"{stack.url}/v1/chat/completions", data=body, headers=JSON, timeout=30),
               "messages.0.weight")


@pytest.mark.parametrize("field,value", [
    ("temperature", 1e308), ("temperature", 100.5), ("top_p", 1e308), ("repetition_penalty", 1e308),
    ("presence_penalty", 1e308), ("frequency_penalty", -1e308), ("min_p", 1e308), ("top_k", 2**70),
    ("max_tokens", 10**30), ("seed", 2**70),
])
def test_absurd_values_name_their_field(stack, field, value):
    assert_400(requests.post(f"{stack.url}/v1/completions", json={**PROMPT, field: value}, timeout=30), field)


def test_absurd_logit_bias(stack):
    body = {**PROMPT, "logit_bias": {"5": 1e308}}
    assert_400(requests.post(f"{stack.url}/v1/completions", json=body, timeout=30), "logit_bias")


def test_what_the_sdk_sends_stays_valid(stack):
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    # ints where floats are expected, as OpenAI takes them; None is sent as null, meaning the default
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=1, top_p=1,
                                    presence_penalty=0, frequency_penalty=-1, logit_bias={"5": 1}, seed=3, n=2,
                                    stop=["zzz"], logprobs=2, user=None, suffix=None,
                                    extra_body={"top_k": 5, "min_p": 0, "repetition_penalty": 1, "min_tokens": 1})
    assert len(out.choices) == 2 and out.choices[0].logprobs is not None
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}], max_completion_tokens=64, temperature=2, logprobs=True, top_logprobs=1,
                                          max_tokens=None)
    assert chat.choices[0].message.content == REPLY
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, stream=True, stream_options={"include_usage": True})
    assert [c for c in stream][-1].usage.completion_tokens == 4
    # leaving model out still means the only model
    r = requests.post(f"{stack.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def admin_stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("strict-admin"), admin_key=ADMIN_KEY) as s:
        yield s


@pytest.mark.parametrize("path,body,param", [
    ("/admin/models", {"name": "m", "keep_alive_s": "30"}, "keep_alive_s"),
    ("/admin/models", {"name": "m", "pinned": 1}, "pinned"),
    ("/admin/tenants", {"name": "t", "rpm": "5"}, "rpm"),
    ("/admin/tenants", {"name": "t", "models": "tiny"}, "models"),
    ("/admin/keys", {"tenant": 5}, "tenant"),
])
def test_admin_bodies_are_strict_too(admin_stack, path, body, param):
    r = requests.post(f"{admin_stack.url}{path}", json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                      timeout=30)
    assert_400(r, param)


def test_admin_bodies_refuse_non_finite_numbers(admin_stack):
    r = requests.post(f"{admin_stack.url}/admin/models", data=b'{"name": "m", "keep_alive_s": NaN}',
                      headers={"Authorization": f"Bearer {ADMIN_KEY}", **JSON}, timeout=30)
    assert_400(r, "keep_alive_s")
