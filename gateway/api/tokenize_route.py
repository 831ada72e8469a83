"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes); they need the tokenizer, not a worker."""

from aiohttp import web

from kvrelay.gateway.api.prompts import check_token_ids, render_chat
from kvrelay.gateway.api.schemas import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest, parse
from kvrelay.gateway.api.tokenizer_pool import TOKENIZERS
from kvrelay.gateway.bodies import read_json
from kvrelay.gateway.control.served import resolve_model
from kvrelay.gateway.errors import bad_request
from kvrelay.gateway.tenancy.auth import TENANT


async def tokenize(request: web.Request) -> web.Response:
    body = parse(TokenizeRequest, await read_json(request))
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    model = await resolve_model(request.app, body.model, request[TENANT].may_use)
    tokenizer = await request.app[TOKENIZERS].get(model)
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await tokenizer.encode(body.prompt, add_special_tokens=add_special)
    else:
        chat = ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt)
        ids = await render_chat(tokenizer, chat, add_special_tokens=bool(body.add_special_tokens))
    return web.json_response({"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids})


async def detokenize(request: web.Request) -> web.Response:
    body = parse(DetokenizeRequest, await read_json(request))
    model = await resolve_model(request.app, body.model, request[TENANT].may_use)
    check_token_ids(body.tokens, model, "tokens")
    tokenizer = await request.app[TOKENIZERS].get(model)
    return web.json_response({"prompt": tokenizer.decode(body.tokens)})
