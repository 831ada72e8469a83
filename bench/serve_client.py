"""The load generator behind ``kvrelay bench serve``: the prompts, one streamed OpenAI request timed
chunk by chunk, and the arrival schedule (fixed concurrency, Poisson arrivals, or both), all through one
aiohttp session so the client costs little next to the server it measures."""

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp

# A small built-in set for --dataset text: varied lengths and topics, no external data needed.
TEXT_PROMPTS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about a lighthouse keeper.",
    "List three advantages of unit tests.",
    "How does a hash map handle collisions?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "Give me a recipe for a simple tomato soup.",
    "What is the difference between a process and a thread?",
    "Translate 'good morning, how are you?' into Spanish and German.",
    "Why do cats purr?",
    "Describe the water cycle to a ten-year-old.",
    "Write a Python function that reverses a string.",
]


@dataclass
class Prompt:
    text: str | None = None  # --dataset text
    token_ids: list[int] | None = None  # --dataset random

    @property
    def input_len(self) -> int:
        """Known up front for token ids; text prompts are counted by the server's usage."""
        return len(self.token_ids) if self.token_ids is not None else 0


@dataclass
class RequestResult:
    success: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds from sending to the first chunk that carries a token
    latency: float = 0.0  # seconds from sending to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between token-carrying chunks
    text: str = ""
    error: str = ""


def make_prompts(dataset: str, n: int, input_len: int, seed: int, vocab: tuple[int, int]) -> list[Prompt]:
    if dataset == "text":
        return [Prompt(text=TEXT_PROMPTS[i % len(TEXT_PROMPTS)]) for i in range(n)]
    rng = random.Random(seed)
    lo, hi = vocab
    return [Prompt(token_ids=[rng.randrange(lo, hi) for _ in range(input_len)]) for _ in range(n)]


def arrival_offsets(n: int, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process (exponential gaps) at ``request_rate``,
    or all at zero for inf. Seeded, so the offline replay follows the same schedule as the server run."""
    if request_rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


@dataclass
class RequestSpec:
    url: str
    endpoint: str  # completions | chat
    model: str
    output_len: int
    ignore_eos: bool
    cache_salt: str | None  # a fresh salt per run: a repeated run against a warm server stays cold
    # Ask for the sampled token's logprob: a server holds back the text of a token that ends mid UTF-8
    # character (frequent after random-id prompts), but still streams its logprob entry at once, so
    # token times stay exact instead of shifting by a whole decode step.
    token_logprobs: bool = True

    def body(self, prompt: Prompt) -> dict:
        body: dict = {"model": self.model, "temperature": 0.0, "stream": True,
                      "stream_options": {"include_usage": True}, "ignore_eos": self.ignore_eos}
        if self.cache_salt is not None:
            body["cache_salt"] = self.cache_salt
        if self.endpoint == "chat":
            body.update(messages=[{"role": "user", "content": prompt.text}], max_completion_tokens=self.output_len)
            if self.token_logprobs:
                body.update(logprobs=True, top_logprobs=0)
        else:
            body.update(prompt=prompt.token_ids if prompt.token_ids is not None else prompt.text,
                        max_tokens=self.output_len)
            if self.token_logprobs:
                body["logprobs"] = 0
        return body


def _tokens_in(chunk: dict, endpoint: str) -> tuple[str, int]:
    """The chunk's text and how many tokens it carries (its logprob entries; else 1 if it has text)."""
    choices = chunk.get("choices")
    if not choices:
        return "", 0
    choice = choices[0]
    logprobs = choice.get("logprobs") or {}
    if endpoint == "chat":  # the opening chunk carries only the role: it is not a token
        text = (choice.get("delta") or {}).get("content") or ""
        entries = logprobs.get("content")
    else:
        text = choice.get("text") or ""
        entries = logprobs.get("tokens")
    return text, len(entries) if entries else int(bool(text))


async def send(session: aiohttp.ClientSession, spec: RequestSpec, prompt: Prompt) -> RequestResult:
    r = RequestResult(prompt_tokens=prompt.input_len)
    pieces: list[str] = []
    chunks = tokens = 0
    done = False
    start = last = time.perf_counter()
    try:
        async with session.post(spec.url, json=spec.body(prompt)) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return r
            async for raw in resp.content:  # SSE: one "data: {...}" line per event
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    r.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
                    return r
                if usage := chunk.get("usage"):
                    r.prompt_tokens = usage.get("prompt_tokens", r.prompt_tokens)
                    r.output_tokens = usage.get("completion_tokens", 0)
                piece, n = _tokens_in(chunk, spec.endpoint)
                pieces.append(piece)
                if n:
                    now = time.perf_counter()
                    if chunks == 0:
                        r.ttft = now - start
                    else:
                        r.itl.append(now - last)
                    last = now
                    chunks += 1
                    tokens += n
        r.latency = time.perf_counter() - start
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        r.error = f"{type(exc).__name__}: {exc}"
        return r
    if not done:
        r.error = "stream ended without [DONE]"
        return r
    r.text = "".join(pieces)
    r.output_tokens = r.output_tokens or tokens  # a server that sends no usage: our own count
    r.success = chunks > 0
    if not r.success:
        r.error = "no token in the stream"
    return r


async def first_model(base_url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"{base_url}/models") as resp:
        resp.raise_for_status()
        data = (await resp.json())["data"]
    if not data:
        raise RuntimeError(f"{base_url}/models lists no model")
    return data[0]["id"]


async def run_load(base_url: str, spec: RequestSpec, prompts: list[Prompt], offsets: list[float],
                   max_concurrency: int | None, timeout_s: float) -> tuple[list[RequestResult], float]:
    """Every prompt once, each sent at its offset (and once a concurrency slot is free). Returns the
    results in prompt order and the wall time from the first send to the last response."""
    # one connection per in-flight request: no request waits for a socket, none are opened in excess
    connector = aiohttp.TCPConnector(limit=max_concurrency or len(prompts))
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(session: aiohttp.ClientSession, prompt: Prompt) -> RequestResult:
        if sem is None:
            return await send(session, spec, prompt)
        async with sem:
            return await send(session, spec, prompt)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = []
        start = time.perf_counter()
        for prompt, offset in zip(prompts, offsets, strict=True):
            wait = start + offset - time.perf_counter()
            if wait > 0:  # absolute send times: sleep overshoot does not accumulate into drift
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(session, prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(results), duration
