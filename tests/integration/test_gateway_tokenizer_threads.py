"""Many concurrent long prompts through the gateway's real tokenization path (``/tokenize``: the same
ModelTokenizer encode and chat rendering that completions use, on the gateway's tokenization threads),
against real Redis and the fake worker: every prompt comes back whole and exactly as a tokenizer of its
own encodes it, also while the event loop's tokenizer has its settings changed under them (a Hugging
Face fast tokenizer keeps truncation as state on one Rust object: shared across threads, one call's
setting cuts another thread's prompt)."""

import asyncio
import random
import threading

import aiohttp
import pytest
from aiohttp import web

from kvrelay.gateway.api import tokenizer_pool
from kvrelay.gateway.api.tokenizer_pool import TOKENIZERS, ModelTokenizer
from kvrelay.gateway.control.worker_registry import WORKER_REGISTRY
from tests.integration.gateway_harness import MODEL, running_stack

pytestmark = pytest.mark.timeout(180)
WORDS = ["hello", "there", "quick", "brown", "fox", "lazy", "dog", "story", "über", "12345", "!?", "\n"]
CONCURRENT = 48


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # several tokenization threads whatever this machine's core count: threads against threads as well
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tokenizer_pool, "TOKENIZER_THREADS", 4)
        with running_stack(tmp_path_factory.mktemp("tokenizer-threads")) as s:
            yield s


def long_text(seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3_000, 6_000)))  # >> the inline limit


def bodies() -> list[dict]:
    out = []
    for i in range(CONCURRENT):
        if i % 3 == 2:
            out.append({"model": MODEL, "messages": [{"role": "user", "content": long_text(i)}]})
        else:
            out.append({"model": MODEL, "prompt": long_text(i), "add_special_tokens": bool(i % 2)})
    return out


def expected(stack, body: dict) -> list[int]:
    tok = stack.tokenizer  # the fake worker's own, in this process
    if "prompt" in body:
        return tok.encode(body["prompt"], add_special_tokens=body["add_special_tokens"])
    text = tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


async def tokenize_all(url: str, all_bodies: list[dict]) -> list[tuple[int, dict]]:
    async with aiohttp.ClientSession() as http:
        async def one(body: dict) -> tuple[int, dict]:
            async with http.post(f"{url}/tokenize", json=body) as r:
                return r.status, await r.json()

        return await asyncio.gather(*(one(b) for b in all_bodies))


def check(stack, results: list[tuple[int, dict]], all_bodies: list[dict]) -> None:
    assert [status for status, _ in results] == [200] * len(all_bodies), results[:3]
    for (_, got), body in zip(results, all_bodies, strict=True):
        want = expected(stack, body)
        assert len(want) > 1000 and got["count"] == len(want) and got["tokens"] == want


def test_concurrent_long_prompts_tokenize_exactly(stack):
    all_bodies = bodies()
    for _ in range(3):  # the first round also loads each thread's tokenizer while others encode
        check(stack, asyncio.run(tokenize_all(stack.url, all_bodies)), all_bodies)


def test_settings_changed_on_one_thread_never_reach_another(stack):
    """Truncation switched on and off on the event loop's tokenizer (as a request asking for its prompt
    truncated would) while long prompts encode on the tokenization threads: none of them is cut."""
    server = stack.server
    model = asyncio.run_coroutine_threadsafe(_model_tokenizer(server.app), server.loop).result(30)
    stop = threading.Event()

    async def truncating_caller() -> int:
        calls = 0
        while not stop.is_set():
            model.hf.encode("hello there " * 20, truncation=True, max_length=8)
            model.hf.encode("hello there")  # and off again
            calls += 1
            await asyncio.sleep(0)
        return calls

    caller = asyncio.run_coroutine_threadsafe(truncating_caller(), server.loop)
    try:
        all_bodies = bodies()
        results = [asyncio.run(tokenize_all(stack.url, all_bodies)) for _ in range(3)]
    finally:
        stop.set()
    assert caller.result(10) > 0
    for round_results in results:
        check(stack, round_results, all_bodies)


async def _model_tokenizer(app: web.Application) -> ModelTokenizer:
    """The gateway's own tokenizer of the model, the one its event loop uses."""
    return await app[TOKENIZERS].get(await app[WORKER_REGISTRY].model(MODEL, fresh=True))
