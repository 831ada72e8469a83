"""From a validated request body to what the workers get: model resolved, prompt(s) tokenized, limits
checked, sampling parameters final. Every check runs here, before anything is queued. Order: what the
body alone tells (400), the model (404, or 403 when the tenant may not use it), live workers (503: the
tokenizer may live only where the workers are; a registered model no worker holds is loaded first,
the request waiting), then everything that needs the tokenizer (400).
"""

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web

from kvrelay.gateway.api.beam_params import check_beam_search
from kvrelay.gateway.api.fill_in_middle import fill_in_middle
from kvrelay.gateway.api.forced_calls import call_constraint
from kvrelay.gateway.api.sampling_defaults import apply_defaults, default_chat_max_tokens
from kvrelay.gateway.api.schemas import CHAT_ROLES, ChatCompletionRequest, CompletionRequest, parse
from kvrelay.gateway.api.tokenizer_pool import TOKENIZERS, ModelTokenizer
from kvrelay.gateway.api.tool_schemas import NO_TOOLS, ToolPlan, plan_tools, template_history
from kvrelay.gateway.control.model_registry import MODEL_REGISTRY
from kvrelay.gateway.control.served import require_capacity, resolve_served
from kvrelay.gateway.errors import APIError, bad_request
from kvrelay.gateway.state import CONFIG
from kvrelay.gateway.tenancy.tenants import Tenant
from kvrelay.shared.wire.protocol import ModelInfo
from kvrelay.shared.wire.sampling_params import SamplingParams

log = logging.getLogger("kvrelay.gateway")
B = TypeVar("B", CompletionRequest, ChatCompletionRequest)
# Choices (prompts x n) one request may fan out into; each is a job and a worker sequence.
MAX_JOBS_PER_REQUEST = 1024
# Tool-call parsers whose markers some models' tokenizers hold as special tokens ([TOOL_CALLS] in Mistral's,
# <tool_call> in Hermes 2 Pro's): their text must not be skipped in the reply, or no call is ever found.
SPECIAL_MARKERS = ("hermes", "mistral")


@dataclass
class Prepared:
    model: ModelInfo  # model.name is the instance key ("name@3"): the stream and handoff identity
    tokenizer: ModelTokenizer
    prompts: list[list[int]]
    params: SamplingParams
    tenant: str
    priority: int
    cache_salt: str | None
    served_name: str = ""  # the client's model name, what responses show; "" = model.name
    tools: ToolPlan = NO_TOOLS  # chat: the tools offered and how the reply is parsed
    returned_n: int | None = None  # best_of > n: params.n choices are sampled per prompt, this many returned
    constraint_param: str | None = None  # the field that set params.structured_outputs: what its errors name

    @property
    def model_name(self) -> str:
        return self.served_name or self.model.name


def check_token_ids(ids: list[int], model: ModelInfo, param: str) -> None:
    for token_id in ids:
        if not 0 <= token_id < model.vocab_size:
            raise bad_request(f"token id {token_id} is out of vocabulary (size {model.vocab_size})", param)


def check_length(prompt_len: int, max_tokens: int | None, model: ModelInfo, what: str, param: str) -> None:
    limit = model.max_model_len
    if prompt_len >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, your {what} "
                          f"has {prompt_len} tokens, leaving no room for the completion.", param,
                          code="context_length_exceeded")
    if max_tokens is not None and prompt_len + max_tokens > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                          f"{prompt_len + max_tokens} tokens ({prompt_len} in the {what}, {max_tokens} in "
                          f"the completion). Please reduce the length of the {what} or completion.",
                          "max_tokens", code="context_length_exceeded")


def _check_jobs(num_prompts: int, params: SamplingParams) -> None:
    if num_prompts * params.n > MAX_JOBS_PER_REQUEST:
        raise bad_request(f"{num_prompts} prompts x n={params.n} exceeds {MAX_JOBS_PER_REQUEST} choices", "n")


def _check_logprobs(params: SamplingParams, body: CompletionRequest | ChatCompletionRequest, model: ModelInfo,
                    max_logprobs: int) -> None:
    """``--max-logprobs`` (vLLM's): each logprobs count the request asks for, -1 counting as the vocabulary."""
    if max_logprobs < 0:
        return
    field = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
    # echo with logprobs asks for prompt logprobs under the logprobs field's name
    prompt_field = "prompt_logprobs" if body.prompt_logprobs is not None else field
    for name, value in ((field, params.logprobs), (prompt_field, params.prompt_logprobs)):
        wanted = model.vocab_size if value == -1 else value
        if wanted is not None and wanted > max_logprobs:
            whole = " (-1: the whole vocabulary)" if value == -1 else ""
            raise bad_request(f"{name} asks for {wanted} logprobs per token{whole}; this server allows at most "
                              f"{max_logprobs} (--max-logprobs)", name)


def _finish(served: str, model: ModelInfo, tokenizer: ModelTokenizer, prompts: list[list[int]],
            params: SamplingParams, body: CompletionRequest | ChatCompletionRequest, tenant: Tenant,
            max_logprobs: int) -> Prepared:
    check_token_ids(params.stop_token_ids, model, "stop_token_ids")
    check_token_ids(list(params.logit_bias or ()), model, "logit_bias")
    check_token_ids(params.allowed_token_ids or [], model, "allowed_token_ids")
    _check_logprobs(params, body, model, max_logprobs)
    _check_jobs(len(prompts), params)
    if body.priority and model.scheduling_policy != "priority":
        # vLLM's answer too: under first-come-first-served the field would be accepted and ignored
        raise bad_request(f"priority {body.priority} needs workers started with --scheduling-policy priority; "
                          f"model {served!r} is served first come, first served", "priority")
    if params.use_beam_search:
        check_beam_search(body, params, len(model.eos_token_ids))
    return Prepared(model=model, tokenizer=tokenizer, prompts=prompts, params=params, tenant=tenant.name,
                    priority=tenant.job_priority(body.priority), cache_salt=tenant.job_cache_salt(body.cache_salt),
                    served_name=served, returned_n=body.n if params.n > body.n else None,
                    constraint_param=body.constraint_param)


async def prepare_completion(app: web.Application, raw: Any,
                             tenant: Tenant) -> tuple[Prepared, CompletionRequest]:
    """The prepared request and the body as prepared (model defaults applied): what to answer from.
    ``raw`` is the decoded JSON body as sent."""
    return await _on_the_served_version(app, lambda: _server_wide(app, parse(CompletionRequest, raw)),
                                        lambda b: _prepare_completion(app, b, tenant))


async def prepare_chat(app: web.Application, raw: Any, tenant: Tenant) -> tuple[Prepared, ChatCompletionRequest]:
    return await _on_the_served_version(app, lambda: _server_wide(app, parse(ChatCompletionRequest, raw)),
                                        lambda b: _prepare_chat(app, b, tenant))


def _server_wide(app: web.Application, body: B) -> B:
    """The body with what the server's flags ask of every request (--return-tokens-as-token-ids)."""
    if app[CONFIG].return_tokens_as_token_ids:
        body.return_tokens_as_token_ids = True
    return body


# A request's instance is resolved before its tokenizer loads and its prompt is encoded, which can take
# seconds; a version swap meanwhile drains that instance, and a job queued to it after the drain would wait
# for a worker that no longer serves it until its deadline. So one whose name moved to another version
# meanwhile is prepared again for that version, from the body as the client sent it (the defaults and
# tokenizer may differ). The swap waits out the spec cache before
# draining, so the cached spec read just before the job is queued is enough.
PREPARE_ATTEMPTS = 3


async def _on_the_served_version(app: web.Application, parse_body: Callable[[], B],
                                 prepare: Callable[[B], Awaitable[Prepared]]) -> tuple[Prepared, B]:
    for _ in range(PREPARE_ATTEMPTS):
        used = parse_body()  # parsed again for each try: a try applies its version's defaults to the body
        prepared = await prepare(used)
        spec = (await app[MODEL_REGISTRY].specs()).get(prepared.served_name)
        if spec is None or spec.instance == prepared.model.name:
            break
        log.info("%s moved to %s while a request was prepared for %s: preparing it again",
                 prepared.served_name, spec.instance, prepared.model.name)
    return prepared, used


async def _prepare_completion(app: web.Application, body: CompletionRequest, tenant: Tenant) -> Prepared:
    body.check_stream_options()
    params = body.sampling_params()  # what the body alone gets wrong is a 400 before any model lookup
    served, model = await resolve_served(app, body.model, tenant.may_use)
    model = await require_capacity(app, model, served)
    applied = apply_defaults(body, model, app[CONFIG])
    if applied:  # the model's own defaults for what the request left out
        try:
            params = dataclasses.replace(params, **applied)
        except ValueError as exc:  # a default out of range (generation_config.json): named like the body's
            raise bad_request(str(exc), param=str(exc).split(" ", 1)[0]) from None
    tokenizer = await app[TOKENIZERS].get(model)
    raw = body.prompt
    if isinstance(raw, str):
        raw = [raw]
    elif raw and isinstance(raw[0], int):
        raw = [raw]
    if not raw:
        raise bad_request("prompt must not be empty", "prompt")
    prompts = []
    for item in raw:
        if body.suffix:
            ids = await fill_in_middle(tokenizer, item, body.suffix)  # a string: checked in sampling_params
        else:
            ids = await tokenizer.encode(item, add_special_tokens=True) if isinstance(item, str) else list(item)
        if not ids:
            raise bad_request("prompt must not be empty", "prompt")
        check_token_ids(ids, model, "prompt")
        check_length(len(ids), params.max_tokens, model, "prompt", "prompt")
        prompts.append(ids)
    return _finish(served, model, tokenizer, prompts, params, body, tenant, app[CONFIG].max_logprobs)


async def render_chat(tokenizer: ModelTokenizer, body: ChatCompletionRequest, add_special_tokens: bool = False,
                      messages: list[dict] | None = None, tools: list[dict] | None = None) -> list[int]:
    """``messages``: the body's ``template_messages()`` when the caller has them already; ``tools``: those
    offered to the model (the request's ToolPlan)."""
    if messages is None:
        messages = body.template_messages()
    messages, tool_field = template_history(messages)
    if (tools or tool_field) and not await tokenizer.renders_tools():
        field = "tools" if tools else tool_field
        raise bad_request(f"this model's chat template does not render tools, so it can neither be offered them "
                          f"nor read tool calls and results in the history ({field})", field)
    try:
        text = await _render(tokenizer, body, messages, body.chat_template_kwargs, tools)
    except APIError:
        await _check_custom_roles_render(tokenizer, body, messages, tools)
        raise
    await _check_template_uses(tokenizer, body, messages, text, tools)
    # The template already placed BOS and friends; adding them again would double them (as in vLLM).
    return await tokenizer.encode(text, add_special_tokens=add_special_tokens)


async def _render(tokenizer: ModelTokenizer, body: ChatCompletionRequest, messages: list[dict],
                  template_kwargs: dict | None, tools: list[dict] | None) -> str:
    if body.continue_final_message:  # transformers cuts the text after the final message's content
        template_kwargs = {**(template_kwargs or {}), "continue_final_message": True}
    return await tokenizer.render_chat(messages, body.add_generation_prompt, template_kwargs, tools)


async def _check_custom_roles_render(tokenizer: ModelTokenizer, body: ChatCompletionRequest, messages: list[dict],
                                     tools: list[dict] | None) -> None:
    """After a failed render: when the messages render with their custom roles made "user", a custom role is
    what the template failed on, and the 400 names it rather than the template's words alone."""
    custom = [i for i, m in enumerate(messages) if m["role"] not in CHAT_ROLES]
    if not custom:
        return
    plain = [{**m, "role": "user"} if i in custom else m for i, m in enumerate(messages)]
    try:
        await _render(tokenizer, body, plain, body.chat_template_kwargs, tools)
    except APIError:
        return  # it fails for another reason: the template's own error says which
    role = messages[custom[0]]["role"]
    raise bad_request(f"this model's chat template does not accept the role {role!r}", f"messages.{custom[0]}.role")


# Distinct message fields besides role and content one request may carry: each costs a render below.
MAX_MESSAGE_FIELDS = 8
# Message fields a template need not render: the id pairing a tool result with its call, which templates
# that render tools carry by the order of the messages instead (Qwen2.5's, Llama 3.1's)
_ID_FIELDS = {"tool_call_id"}


async def _check_template_uses(tokenizer: ModelTokenizer, body: ChatCompletionRequest, messages: list[dict],
                               text: str, tools: list[dict] | None) -> None:
    """The model's chat template decides which message fields (name, tool_call_id, ...) and which
    chat_template_kwargs it renders. One it ignores would be accepted and ignored: a 400 naming it, found by
    rendering again without it (only when a request carries such fields, which most do not)."""
    async def same_without(msgs: list[dict], kwargs: dict | None) -> bool:
        try:
            return await _render(tokenizer, body, msgs, kwargs, tools) == text
        except APIError:  # the template cannot do without it: it is used
            return False

    # a custom role the template leaves out would drop its messages: found by rendering without them
    custom = list(dict.fromkeys(m["role"] for m in messages if m["role"] not in CHAT_ROLES))
    if len(custom) > MAX_MESSAGE_FIELDS:
        raise bad_request(f"messages use {len(custom)} custom roles; at most {MAX_MESSAGE_FIELDS} are accepted",
                          "messages")
    for role in custom:
        if await same_without([m for m in messages if m["role"] != role], body.chat_template_kwargs):
            first = next(i for i, m in enumerate(messages) if m["role"] == role)
            raise bad_request(f"this model's chat template leaves out messages of role {role!r}", f"messages.{first}.role")
    if body.chat_template_kwargs and await same_without(messages, None):
        raise bad_request("chat_template_kwargs have no effect on this model's chat template", "chat_template_kwargs")
    extra = sorted({k for m in messages for k in m} - {"role", "content"})
    if len(extra) > MAX_MESSAGE_FIELDS:
        raise bad_request(f"messages use {len(extra)} distinct fields besides role and content; at most "
                          f"{MAX_MESSAGE_FIELDS} are accepted", "messages")
    for key in extra:
        if key in _ID_FIELDS:
            continue
        without = [{k: v for k, v in m.items() if k != key} for m in messages]
        if await same_without(without, body.chat_template_kwargs):
            first = next(i for i, m in enumerate(messages) if key in m)
            raise bad_request(f"messages.{first}.{key} has no effect on this model's chat template",
                              f"messages.{first}.{key}")


async def _prepare_chat(app: web.Application, body: ChatCompletionRequest, tenant: Tenant) -> Prepared:
    body.check_stream_options()
    messages = body.template_messages()  # role and emptiness errors before any model lookup
    config = app[CONFIG]
    tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, config.tool_call_parser,
                       config.enable_auto_tool_choice)
    template_history(messages)  # the history's tool parts too
    served, model = await resolve_served(app, body.model, tenant.may_use)
    model = await require_capacity(app, model, served)
    tokenizer = await app[TOKENIZERS].get(model)
    offered = tools.tools
    if tools.forced is not None and not await tokenizer.renders_tools():
        # A forced call's name and arguments come from the tools through the output's schema, so a template
        # that cannot show them to the model leaves them in effect (as vLLM serves such a request)
        offered = None
    ids = await render_chat(tokenizer, body, messages=messages, tools=offered)
    if not ids:
        raise bad_request("messages rendered to an empty prompt", "messages")
    check_length(len(ids), None, model, "messages", "messages")
    # The tokenizer may know more ids than the model embeds (a mismatched deployment): refuse here,
    # not as a worker error after queueing
    check_token_ids(ids, model, "messages")
    apply_defaults(body, model, app[CONFIG])
    remaining = model.max_model_len - len(ids)
    if body.max_tokens is None and body.max_completion_tokens is None:
        body.max_tokens = default_chat_max_tokens(model, app[CONFIG], remaining)
    params = body.sampling_params(remaining_context=remaining, forced_call=call_constraint(tools, body.tools or []))
    check_length(len(ids), params.max_tokens, model, "messages", "messages")
    if tools.parser in SPECIAL_MARKERS:  # the markers the parser looks for are special tokens (as in vLLM)
        params = dataclasses.replace(params, skip_special_tokens=False)
    return dataclasses.replace(_finish(served, model, tokenizer, [ids], params, body, tenant,
                                       app[CONFIG].max_logprobs), tools=tools)
