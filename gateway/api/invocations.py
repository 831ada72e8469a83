"""``POST /invocations``, SageMaker's one inference route, as vLLM serves it: the body's shape picks the
endpoint. A body with ``messages`` is a chat completion, one with ``prompt`` a completion (vLLM tries its
chat request model first, then its completion one, and answers 400 when neither fits). The chosen
handler reads the same body (aiohttp keeps it once read), so the two routes' validation, tenancy,
metering and streaming are the ones ``/v1/...`` has."""

from aiohttp import web

from kvrelay.gateway.api.chat import create_chat_completion
from kvrelay.gateway.api.completions import create_completion
from kvrelay.gateway.bodies import read_api_json
from kvrelay.gateway.errors import bad_request


async def invocations(request: web.Request) -> web.StreamResponse:
    body = await read_api_json(request)
    if isinstance(body, dict) and "messages" in body:
        return await create_chat_completion(request)
    if isinstance(body, dict) and "prompt" in body:
        return await create_completion(request)
    raise bad_request("/invocations takes a chat completion request (with 'messages') or a completion "
                      "request (with 'prompt'); the body has neither", param="messages")
