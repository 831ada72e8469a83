"""``POST /v1/chat/completions``: the model's chat template, then the same path as completions; with tools
offered (``tool_choice`` "auto", "required" or a named function), the reply's text read into ``tool_calls``
(gateway/api/tool_replies.py)."""

import uuid

from aiohttp import web

from kvrelay.gateway.api import sse
from kvrelay.gateway.api.accounting import Meter
from kvrelay.gateway.api.beam_search import BeamChoice, BeamSearch
from kvrelay.gateway.api.best_of import best_choices
from kvrelay.gateway.api.choice import ChoiceDelta
from kvrelay.gateway.api.generation import Generation
from kvrelay.gateway.api.logprobs import chat_logprobs, prompt_logprobs
from kvrelay.gateway.api.prompts import Prepared, prepare_chat
from kvrelay.gateway.api.schemas import ChatCompletionRequest
from kvrelay.gateway.api.tool_replies import StreamedToolCalls, reply_message
from kvrelay.gateway.bodies import read_api_json
from kvrelay.gateway.tenancy.auth import TENANT


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    prepared, body = await prepare_chat(request.app, await read_api_json(request), request[TENANT])
    async with Meter(request, prepared, body, "chat.completions") as meter:
        if meter.cached is not None:
            return meter.cached
        if prepared.params.use_beam_search:
            return await _beam_search(request, prepared, meter, body)
        async with Generation(request, prepared) as gen:
            meter.generation = gen
            base = {"id": f"chatcmpl-{gen.request_id}", "created": int(gen.arrival), "model": prepared.model_name}
            if body.stream:
                return await _stream(request, gen, base, body.include_usage, body.continuous_usage,
                                     body.return_tokens_as_token_ids, prepared, body.echoed())
            async for _ in gen:
                pass
            as_ids = body.return_tokens_as_token_ids
            choices = []
            for c in best_choices(gen.choices, prepared):
                message, finish_reason = reply_message(c.text, c.finish_reason, prepared.tools)
                choices.append({
                    "index": c.index,
                    "message": _echo(message, body.echoed()),
                    "logprobs": chat_logprobs(c.logprobs, as_ids) if c.logprobs is not None and body.logprobs else None,
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                })
            response = {**base, "object": "chat.completion", "choices": choices, "usage": gen.usage(),
                        "prompt_logprobs": prompt_logprobs(prepared.tokenizer, gen.choices[0].prompt_logprobs,
                                                                 gen.choices[0].prompt_logprob_ranks)}
            return await meter.respond(web.json_response(response, dumps=sse.dumps))


def _echo(message: dict, echoed: str) -> dict:
    """echo (vLLM's): the final assistant message the reply continues, before the reply's text."""
    if not echoed:
        return message
    return {**message, "content": echoed + (message.get("content") or "")}


async def _beam_search(request: web.Request, prepared: Prepared, meter: Meter,
                       body: ChatCompletionRequest) -> web.StreamResponse:
    search = BeamSearch(request, prepared, uuid.uuid4().hex)
    meter.generation = search
    base = {"id": f"chatcmpl-{search.request_id}", "created": int(search.arrival), "model": prepared.model_name}
    echoed, as_ids = body.echoed(), body.return_tokens_as_token_ids

    def logprobs(c: BeamChoice) -> dict | None:
        return chat_logprobs(c.logprobs, as_ids) if c.logprobs is not None else None

    if body.stream:  # each choice whole, once the search has ended: its role, content and finish in one chunk
        base = {**base, "object": "chat.completion.chunk"}
        include_usage, continuous = body.include_usage, body.continuous_usage

        def chunks(c: BeamChoice) -> list[dict]:
            message, finish_reason = reply_message(c.text, c.finish_reason, prepared.tools)
            delta = {k: v for k, v in _echo(message, echoed).items() if v is not None}
            usage = {"usage": search.usage() if continuous else None} if include_usage else {}
            return [{**base, "choices": [{"index": c.index, "delta": delta, "logprobs": logprobs(c),
                                          "finish_reason": finish_reason, "stop_reason": None}], **usage}]

        def tail() -> list[dict]:
            return [{**base, "choices": [], "usage": search.usage()}] if include_usage else []

        return await sse.stream(request, search.finished_choices(), head=[], chunks=chunks, tail=tail)
    await search.run()
    choices = []
    for c in search.choices:
        message, finish_reason = reply_message(c.text, c.finish_reason, prepared.tools)
        choices.append({"index": c.index, "message": _echo(message, echoed), "logprobs": logprobs(c),
                        "finish_reason": finish_reason, "stop_reason": None})
    response = {"id": f"chatcmpl-{search.request_id}", "object": "chat.completion", "created": int(search.arrival),
                "model": prepared.model_name, "choices": choices, "usage": search.usage(), "prompt_logprobs": None}
    return await meter.respond(web.json_response(response, dumps=sse.dumps))


async def _stream(request: web.Request, gen: Generation, base: dict, include_usage: bool,
                  continuous_usage: bool, as_ids: bool, prepared: Prepared, echoed: str) -> web.StreamResponse:
    base = {**base, "object": "chat.completion.chunk"}

    def usage_field() -> dict:  # continuous_usage_stats (vLLM's): the usage so far in every chunk, not null
        return {"usage": gen.usage() if continuous_usage else None} if include_usage else {}

    def chunk(index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None,
              stop_reason: int | str | None = None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return {**base, "choices": [choice], **usage_field()}

    # Like OpenAI and vLLM: every choice opens with a chunk that carries only the role (and what echo repeats).
    head = [chunk(c.index, {"role": "assistant", "content": echoed}) for c in gen.choices]

    def tail() -> list[dict]:
        return [{**base, "choices": [], "usage": gen.usage()}] if include_usage else []

    if prepared.tools.reads_calls:
        calls = {c.index: StreamedToolCalls(prepared.tools) for c in gen.choices}

        def tool_chunks(delta: ChoiceDelta) -> list[dict]:
            deltas, finish_reason = calls[delta.index].feed(delta.text, delta.finish_reason)
            logprobs = chat_logprobs(delta.logprobs, as_ids) if delta.logprobs else None
            if logprobs is not None and not deltas:  # the text is held back; its logprobs are not
                deltas = [{}]
            out = [chunk(delta.index, d, logprobs if i == 0 else None) for i, d in enumerate(deltas)]
            if delta.finish_reason is not None:
                out.append(chunk(delta.index, {}, None, finish_reason, delta.stop_reason))
            return out

        return await sse.stream(request, gen, head=head, chunks=tool_chunks, tail=tail)

    def chunks(delta: ChoiceDelta) -> list[dict]:
        if not delta.text and delta.finish_reason is None and not delta.logprobs:
            return []
        content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        logprobs = chat_logprobs(delta.logprobs, as_ids) if delta.logprobs is not None else None
        return [chunk(delta.index, content, logprobs, delta.finish_reason, delta.stop_reason)]

    return await sse.stream(request, gen, head=head, chunks=chunks, tail=tail)
