"""One streamed completion through the ``openai`` SDK, reduced to what load tests check."""

import openai


async def streamed_tokens_and_finish(client: openai.AsyncOpenAI, model: str, prompt: list[int],
                            max_tokens: int) -> tuple[int, str | None]:
    """A completion of ``max_tokens`` (EOS ignored), streamed with usage: (completion tokens, finish reason)."""
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                             extra_body={"ignore_eos": True},
                                             stream_options={"include_usage": True})
    usage, finish = None, None
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return usage.completion_tokens, finish
