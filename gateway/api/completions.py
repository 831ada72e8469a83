"""``POST /v1/completions``: OpenAI's text completions, vLLM's extras."""

import uuid

from aiohttp import web

from kvrelay.gateway.api import sse
from kvrelay.gateway.api.accounting import Meter
from kvrelay.gateway.api.beam_search import BeamChoice, BeamSearch
from kvrelay.gateway.api.best_of import best_choices
from kvrelay.gateway.api.choice import ChoiceDelta, ChoiceState
from kvrelay.gateway.api.echo import echo_logprobs, prompt_texts
from kvrelay.gateway.api.generation import Generation
from kvrelay.gateway.api.logprobs import completion_logprobs, prompt_logprobs
from kvrelay.gateway.api.prompts import Prepared, prepare_completion
from kvrelay.gateway.api.schemas import CompletionRequest
from kvrelay.gateway.bodies import read_api_json
from kvrelay.gateway.tenancy.auth import TENANT


async def create_completion(request: web.Request) -> web.StreamResponse:
    prepared, body = await prepare_completion(request.app, await read_api_json(request), request[TENANT])
    async with Meter(request, prepared, body, "completions") as meter:
        if meter.cached is not None:
            return meter.cached
        if prepared.params.use_beam_search:
            return await _beam_search(request, prepared, body, meter)
        async with Generation(request, prepared) as gen:
            meter.generation = gen
            base = {"id": f"cmpl-{gen.request_id}", "object": "text_completion", "created": int(gen.arrival),
                    "model": prepared.model_name}
            if body.stream:
                echoed = prompt_texts(body, prepared) if body.echo else None
                return await _stream(request, gen, base, body, prepared, echoed)
            async for _ in gen:
                pass
            tokenizer = prepared.tokenizer
            echoed = prompt_texts(body, prepared) if body.echo else None
            choices = [{
                "index": c.index,
                "text": c.text if echoed is None else echoed[c.prompt_index] + c.text,
                "logprobs": _logprobs(body, prepared, c, echoed) if body.logprobs is not None else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                # echo with logprobs asks the worker for prompt logprobs; shown here only when asked for
                "prompt_logprobs": prompt_logprobs(tokenizer, c.prompt_logprobs, c.prompt_logprob_ranks)
                if body.prompt_logprobs is not None else None,
            } for c in best_choices(gen.choices, prepared)]
            response = {**base, "choices": choices, "usage": gen.usage()}
            return await meter.respond(web.json_response(response, dumps=sse.dumps))


async def _beam_search(request: web.Request, prepared: Prepared, body: CompletionRequest,
                       meter: Meter) -> web.StreamResponse:
    search = BeamSearch(request, prepared, uuid.uuid4().hex)
    meter.generation = search
    base = {"id": f"cmpl-{search.request_id}", "object": "text_completion", "created": int(search.arrival),
            "model": prepared.model_name}
    as_ids = body.return_tokens_as_token_ids

    def choice(c: BeamChoice) -> dict:
        return {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "stop_reason": None,
                "logprobs": completion_logprobs(c.logprobs, as_ids) if c.logprobs is not None else None,
                "prompt_logprobs": None}

    if body.stream:  # each choice whole, once the search has ended
        include_usage, continuous = body.include_usage, body.continuous_usage

        def chunks(c: BeamChoice) -> list[dict]:
            usage = {"usage": search.usage() if continuous else None} if include_usage else {}
            return [{**base, "choices": [choice(c)], **usage}]

        def tail() -> list[dict]:
            return [{**base, "choices": [], "usage": search.usage()}] if include_usage else []

        return await sse.stream(request, search.finished_choices(), head=[], chunks=chunks, tail=tail)
    await search.run()
    response = {**base, "choices": [choice(c) for c in search.choices], "usage": search.usage()}
    return await meter.respond(web.json_response(response, dumps=sse.dumps))


def _logprobs(body: CompletionRequest, prepared: Prepared, c: ChoiceState, echoed: list[str] | None) -> dict | None:
    if c.logprobs is None:
        return None
    output = completion_logprobs(c.logprobs, body.return_tokens_as_token_ids)
    if echoed is None:
        return output
    return echo_logprobs(prepared, prepared.prompts[c.prompt_index], echoed[c.prompt_index], c.prompt_logprobs,
                         output, body.logprobs or 0, body.return_tokens_as_token_ids)


async def _stream(request: web.Request, gen: Generation, base: dict, body: CompletionRequest, prepared: Prepared,
                  echoed: list[str] | None) -> web.StreamResponse:
    include_usage, continuous_usage, as_ids = body.include_usage, body.continuous_usage, body.return_tokens_as_token_ids
    # echo with logprobs: the prompt's logprobs come with the worker's first event, so each choice's prompt
    # goes out in its first chunk, before its first text and with its logprobs (as vLLM streams it); offsets
    # count in the echoed text from there on
    echo_with_logprobs = echoed is not None and body.logprobs is not None
    unechoed = {c.index for c in gen.choices} if echo_with_logprobs else set()

    # With include_usage every chunk carries "usage": null and a last chunk the totals (OpenAI's contract).
    def usage_field() -> dict:  # continuous_usage_stats (vLLM's): the usage so far in every chunk, not null
        return {"usage": gen.usage() if continuous_usage else None} if include_usage else {}

    def chunks(delta: ChoiceDelta) -> list[dict]:
        if not delta.text and delta.finish_reason is None and not delta.logprobs:
            return []  # text held back (partial stop string, incomplete UTF-8): nothing to say yet
        text = delta.text
        logprobs = completion_logprobs(delta.logprobs, as_ids) if delta.logprobs is not None else None
        if echo_with_logprobs:
            assert echoed is not None and logprobs is not None
            c = gen.choices[delta.index]
            prompt_text = echoed[c.prompt_index]
            if delta.index in unechoed:
                unechoed.discard(delta.index)
                text = prompt_text + text
                logprobs = echo_logprobs(prepared, prepared.prompts[c.prompt_index], prompt_text, c.prompt_logprobs,
                                         logprobs, body.logprobs or 0, as_ids)
            else:
                logprobs["text_offset"] = [len(prompt_text) + o for o in logprobs["text_offset"]]
        choice = {"index": delta.index, "text": text, "logprobs": logprobs,
                  "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
        return [{**base, "choices": [choice], **usage_field()}]

    def tail() -> list[dict]:
        return [{**base, "choices": [], "usage": gen.usage()}] if include_usage else []

    # echo without logprobs: each choice opens with its prompt
    head = [{**base, "choices": [{"index": c.index, "text": echoed[c.prompt_index], "logprobs": None,
                                  "finish_reason": None, "stop_reason": None}], **usage_field()}
            for c in gen.choices] if echoed and not echo_with_logprobs else []
    return await sse.stream(request, gen, head=head, chunks=chunks, tail=tail)
