"""``POST /v1/completions``: OpenAI's text completions, vLLM's extras."""

from aiohttp import web

from kvrelay.gateway.api import sse
from kvrelay.gateway.api.accounting import Meter
from kvrelay.gateway.api.choice import ChoiceDelta
from kvrelay.gateway.api.generation import Generation
from kvrelay.gateway.api.logprobs import completion_logprobs, prompt_logprobs
from kvrelay.gateway.api.prompts import prepare_completion
from kvrelay.gateway.bodies import read_json
from kvrelay.gateway.tenancy.auth import TENANT


async def create_completion(request: web.Request) -> web.StreamResponse:
    prepared, body = await prepare_completion(request.app, await read_json(request), request[TENANT])
    async with Meter(request, prepared, body, "completions") as meter:
        if meter.cached is not None:
            return meter.cached
        async with Generation(request, prepared) as gen:
            meter.generation = gen
            base = {"id": f"cmpl-{gen.request_id}", "object": "text_completion", "created": int(gen.arrival),
                    "model": prepared.model_name}
            if body.stream:
                return await _stream(request, gen, base, body.include_usage, body.continuous_usage,
                                     body.return_tokens_as_token_ids)
            async for _ in gen:
                pass
            as_ids = body.return_tokens_as_token_ids
            tokenizer = prepared.tokenizer
            choices = [{
                "index": c.index,
                "text": c.text,
                "logprobs": completion_logprobs(c.logprobs, as_ids) if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "prompt_logprobs": prompt_logprobs(tokenizer, c.prompt_logprobs, c.prompt_logprob_ranks),
            } for c in gen.choices]
            response = {**base, "choices": choices, "usage": gen.usage()}
            return await meter.respond(web.json_response(response, dumps=sse.dumps))


async def _stream(request: web.Request, gen: Generation, base: dict, include_usage: bool,
                  continuous_usage: bool, as_ids: bool) -> web.StreamResponse:
    # With include_usage every chunk carries "usage": null and a last chunk the totals (OpenAI's contract).
    def usage_field() -> dict:  # continuous_usage_stats (vLLM's): the usage so far in every chunk, not null
        return {"usage": gen.usage() if continuous_usage else None} if include_usage else {}

    def chunks(delta: ChoiceDelta) -> list[dict]:
        if not delta.text and delta.finish_reason is None and not delta.logprobs:
            return []  # text held back (partial stop string, incomplete UTF-8): nothing to say yet
        choice = {"index": delta.index, "text": delta.text,
                  "logprobs": completion_logprobs(delta.logprobs, as_ids) if delta.logprobs is not None else None,
                  "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
        return [{**base, "choices": [choice], **usage_field()}]

    def tail() -> list[dict]:
        return [{**base, "choices": [], "usage": gen.usage()}] if include_usage else []

    return await sse.stream(request, gen, head=[], chunks=chunks, tail=tail)
