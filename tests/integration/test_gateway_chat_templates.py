"""What a chat template decides: custom roles (vLLM passes any role to the template), a message's ``name``
and ``chat_template_kwargs`` are served when the template renders them, and a 400 naming the field when it
fails on them or leaves them out (accepted and ignored, they would change nothing the client can see).
Real Redis, ZMQ and gateway; the fake worker of tests/integration/gateway_harness.py records the prompt."""

import httpx
import pytest

from tests.integration.gateway_harness import MODEL, running_stack

pytestmark = pytest.mark.timeout(120)

# Renders names, the custom role "critic" and a "greeting" argument; leaves out "ghost"; fails on "bad".
# (transformers renders with trim_blocks: a block tag eats the newline after it)
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('no bad role') }}"
    "{% elif m['role'] != 'ghost' %}<|im_start|>{{ m['role'] }}{% if m.get('name') %} ({{ m['name'] }}){% endif %}\n"
    "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}{% if greeting is defined %}{{ greeting }}{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ASK = {"role": "user", "content": "hello"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("templates"), chat_template=TEMPLATE) as s:
        yield s


@pytest.fixture(scope="module")
def plain_stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("templates-plain")) as s:
        yield s


def chat(stack, **fields) -> httpx.Response:
    return httpx.post(f"{stack.url}/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, **fields}, timeout=60)


def prompt(stack, r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    (job,) = stack.jobs_for(r.json()["id"].split("-", 1)[1])
    return stack.tokenizer.decode(job.prompt_token_ids)


def error(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    body = r.json()["error"]
    assert body["param"] == param and body["type"] == "invalid_request_error", body
    return body["message"]


def test_a_custom_role_the_template_renders_is_served(stack):
    text = prompt(stack, chat(stack, messages=[ASK, {"role": "critic", "content": "be brief"}]))
    assert "<|im_start|>criticbe brief<|im_end|>" in text


def test_a_custom_role_the_template_leaves_out_is_a_400(stack):
    r = chat(stack, messages=[ASK, {"role": "ghost", "content": "boo"}])
    assert "leaves out messages of role 'ghost'" in error(r, "messages.1.role")


def test_a_custom_role_the_template_fails_on_is_a_400_naming_it(stack):
    r = chat(stack, messages=[ASK, {"role": "bad", "content": "x"}])
    assert "does not accept the role 'bad'" in error(r, "messages.1.role")


def test_too_many_custom_roles_are_refused_before_rendering_each(stack):
    r = chat(stack, messages=[{"role": f"r{i}", "content": "x"} for i in range(9)])
    assert "custom roles" in error(r, "messages")


def test_a_name_the_template_renders_is_served(stack, plain_stack):
    assert "<|im_start|>user (bob)hello" in prompt(stack, chat(stack, messages=[{**ASK, "name": "bob"}]))
    # the harness's default template renders no names: a 400, not a name silently dropped
    r = chat(plain_stack, messages=[{**ASK, "name": "bob"}])
    assert "no effect" in error(r, "messages.0.name")


def test_chat_template_kwargs_the_template_reads_are_served(stack):
    assert "hey there<|im_start|>assistant" in prompt(stack, chat(stack, messages=[ASK],
                                                                   chat_template_kwargs={"greeting": "hey there"}))
    r = chat(stack, messages=[ASK], chat_template_kwargs={"enable_thinking": False})
    assert "no effect" in error(r, "chat_template_kwargs")
