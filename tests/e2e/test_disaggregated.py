"""The disaggregated path with real processes: gateway -> Redis Streams -> prefill worker -> ZMQ KV
handoff -> decode worker -> token events, driven by the ``openai`` SDK over real HTTP."""

import asyncio
import signal
import time

import httpx
import openai
import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.redis_conn import EmbeddedRedis
from tests.conftest import random_prompts
from tests.e2e.cluster import Cluster, free_port
from tests.e2e.handoff_metrics import by_label, handoffs_settled
from tests.e2e.openai_stream import streamed_tokens_and_finish

pytestmark = pytest.mark.slow
ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "8"]
MODEL = "tiny"
HANG_S = 120.0  # a hang bound, not a speed claim


@pytest.fixture()
def cluster(tiny_dir, redis_url, tmp_path):
    c = Cluster(redis_url, str(tiny_dir), ENGINE + ["--served-model-name", MODEL], tmp_path)
    c.redis.flushall()
    c.start_gateway()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def default_cluster(tiny_dir, tmp_path_factory):
    """A gateway, p1 and d1 with default flags, started once for the tests that need nothing else of them
    (starting the three is most of such a test's time), on a Redis of their own: ``cluster`` flushes the
    session's between tests."""
    with EmbeddedRedis() as url:
        c = Cluster(url, str(tiny_dir), ENGINE + ["--served-model-name", MODEL], tmp_path_factory.mktemp("default"))
        with c.disaggregated():
            yield c


@pytest.fixture(scope="module")
def offline(tiny_dir):
    with LLM(model=str(tiny_dir), dtype="float32", max_model_len=256, block_size=8, num_gpu_blocks=4096) as llm:
        yield llm


def _client(c: Cluster, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.base_url, api_key="none", max_retries=0, **kw)


def _aclient(c: Cluster, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=c.base_url, api_key="none", max_retries=0, **kw)


def test_greedy_equals_offline_engine_under_concurrency(default_cluster, offline):
    """The KV frames go over the decode worker's plain bulk socket, each MAC'd."""
    _check_greedy_under_concurrency(default_cluster, offline)


def test_greedy_equals_offline_engine_under_concurrency_with_encrypted_frames(cluster, offline):
    """The KV frames go encrypted over the decode worker's CURVE socket."""
    cluster.start_worker("prefill", "p1")
    cluster.start_worker("decode", "d1", extra=["--encrypt-kv-frames"])
    cluster.wait_ready()
    _check_greedy_under_concurrency(cluster, offline)


def _check_greedy_under_concurrency(cluster: Cluster, offline: LLM) -> None:
    """Either way the KV frames go, the tokens are the offline engine's."""
    prompts = random_prompts(12, lo=5, hi=80, seed=42)
    expected = [o.outputs[0].token_ids for o in offline.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=16))]

    async def one(client, prompt):
        resp = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0.0,
                                               logprobs=0)
        return resp.choices[0]

    async def run():
        client = _aclient(cluster)
        return await asyncio.gather(*(one(client, p) for p in prompts))

    choices = asyncio.run(run())
    tok = offline.get_tokenizer()
    for choice, want in zip(choices, expected, strict=True):
        assert choice.text == tok.decode(want, skip_special_tokens=True)
        assert len(choice.logprobs.tokens) == len(want)


def test_kv_streamed_layer_by_layer_during_the_last_chunk(cluster, offline):
    """Prompts of several chunks: the prefill worker holds an early grant by the time its last chunk
    runs, so its KV leaves layer by layer during that forward (kvrelay_handoffs_total{streamed="true"});
    greedy tokens still equal the offline engine's."""
    port = free_port()
    cluster.start_worker("prefill", "p1", extra=["--max-num-batched-tokens", "16", "--monitoring-port", str(port)])
    cluster.start_worker("decode", "d1")
    cluster.wait_ready()
    # one request through both workers first: a decode worker that has registered may still be finishing its
    # start, and grants it sends late make every handoff a whole one
    assert _client(cluster).completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2).usage.completion_tokens
    before = handoffs_settled(port, "streamed", 1)
    prompts = random_prompts(6, lo=100, hi=200, seed=7)
    tok = offline.get_tokenizer()
    expected = [tok.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in offline.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=8))]

    async def run():
        client = _aclient(cluster)
        return await asyncio.gather(*(client.completions.create(model=MODEL, prompt=p, max_tokens=8,
                                                                temperature=0.0) for p in prompts))

    assert [r.choices[0].text for r in asyncio.run(run())] == expected
    after = handoffs_settled(port, "streamed", sum(before.values()) + len(prompts))
    counts = {k: v - before.get(k, 0) for k, v in after.items()}
    assert counts.get("true", 0) >= 1 and sum(counts.values()) == len(prompts), counts


def test_decode_worker_reuses_prompt_kv_it_holds_and_is_sent_only_the_rest(cluster, offline):
    """The same prompt of five full blocks twice: the decode worker caches the first handoff's blocks once it runs
    the request, so the second handoff reuses five of its six blocks (kvrelay_handoff_reused_blocks_total) and
    moves one block's KV; greedy tokens are the offline engine's both times."""
    port = free_port()
    cluster.start_worker("prefill", "p1")
    cluster.start_worker("decode", "d1", extra=["--monitoring-port", str(port)])
    cluster.wait_ready()

    def counters() -> tuple[float, float]:
        return (sum(by_label(port, "kvrelay_handoff_reused_blocks_total", "model_name").values()),
                sum(by_label(port, "kvrelay_handoff_received_bytes_total", "model_name").values()))

    prompt = random_prompts(1, lo=41, hi=41, seed=11)[0]  # block size 8: five full blocks and one token
    tok = offline.get_tokenizer()
    expected = tok.decode(offline.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0.0, max_tokens=8))[0].outputs[0].token_ids, skip_special_tokens=True)
    seen = [counters()]
    for _ in range(2):
        resp = _client(cluster).completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0)
        assert resp.choices[0].text == expected
        seen.append(counters())  # the decode worker counts a handoff as it admits it, before its first token
    (reused0, bytes0), (reused1, bytes1), (reused2, bytes2) = seen
    assert reused1 - reused0 == 0 and reused2 - reused1 == 5
    assert 0 < bytes2 - bytes1 and (bytes2 - bytes1) * 6 == bytes1 - bytes0  # one block's KV, of six


def test_64_concurrent_streams_complete(default_cluster):
    cluster = default_cluster

    async def run():
        client = _aclient(cluster, timeout=120)
        return await asyncio.gather(*(streamed_tokens_and_finish(client, MODEL, [5 + i, 6, 7], 20)
                                      for i in range(64)))

    assert asyncio.run(run()) == [(20, "length")] * 64


def test_client_disconnect_frees_decode_blocks(default_cluster):
    cluster = default_cluster
    total = cluster.wait_worker("d1").total_blocks
    with httpx.Client(timeout=30) as http:
        body = {"model": MODEL, "prompt": list(range(5, 100)), "max_tokens": 150, "stream": True, "ignore_eos": True}
        with http.stream("POST", f"{cluster.base_url}/completions", json=body) as resp:
            for n, _line in enumerate(resp.iter_lines()):
                if n > 10:
                    break  # hang up mid-stream
    deadline = time.monotonic() + 60  # a hang bound: the heartbeat record shows the freed seat a beat later
    while time.monotonic() < deadline:
        info = cluster.worker("d1")
        if info.running == 0 and info.free_blocks == total:
            break
        time.sleep(0.3)
    assert info.running == 0 and info.free_blocks == total


def test_more_requests_than_decode_seats_all_complete(cluster):
    # a full batch outlasts the handoff timeout many times over: prefilled requests wait for a seat
    cluster.start_worker("prefill", "p1", ["--handoff-timeout", "0.5"])
    cluster.start_worker("decode", "d1", ["--max-num-seqs", "2"])
    cluster.wait_ready()

    async def one(client, i):
        resp = await client.completions.create(model=MODEL, prompt=[5 + i, 6, 7], max_tokens=200,
                                               extra_body={"ignore_eos": True})
        return resp.usage.completion_tokens

    async def run():
        client = _aclient(cluster, timeout=120)
        return await asyncio.gather(*(one(client, i) for i in range(12)))

    assert asyncio.run(run()) == [200] * 12


def test_killed_prefill_worker_jobs_are_reclaimed(cluster):
    cluster.start_worker("prefill", "p1", ["--reclaim-idle-ms", "1500", "--handoff-timeout", "30"])
    cluster.start_worker("decode", "d1")
    cluster.wait_ready()
    cluster.signal("d1", signal.SIGSTOP)  # p1 will prefill, then wait on a grant: jobs pending at p1
    stream = keys.prefill_stream(MODEL)

    async def one(client, i):
        resp = await client.completions.create(model=MODEL, prompt=[9 + i, 10, 11], max_tokens=12,
                                               temperature=0.0, extra_body={"ignore_eos": True})
        return resp.usage.completion_tokens

    async def run():
        client = _aclient(cluster, timeout=120)
        tasks = [asyncio.create_task(one(client, i)) for i in range(6)]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pending = cluster.redis.xpending(stream, keys.PREFILL_GROUP)
            if pending["pending"] == 6:
                break
            await asyncio.sleep(0.1)
        assert pending["pending"] == 6
        cluster.kill("p1")
        cluster.signal("d1", signal.SIGCONT)
        cluster.start_worker("prefill", "p2", ["--reclaim-idle-ms", "1500"])
        return await asyncio.gather(*tasks)

    assert asyncio.run(run()) == [12] * 6
    assert cluster.redis.xpending(stream, keys.PREFILL_GROUP)["pending"] == 0


def test_killed_decode_worker_ends_streams_cleanly(cluster):
    cluster.start_worker("prefill", "p1")
    cluster.start_worker("decode", "d1")
    cluster.wait_ready()
    events = [0] * 4
    finished = [False] * 4  # its finish reason came: complete before the worker was stopped, nothing to cut

    async def one(client, i):
        error = None
        try:
            stream = await client.completions.create(model=MODEL, prompt=[20 + i, 5], max_tokens=200, stream=True,
                                                     extra_body={"ignore_eos": True})
            async for chunk in stream:
                events[i] += 1
                finished[i] |= any(c.finish_reason for c in chunk.choices)
        except openai.APIError as exc:
            error = exc
        return error

    async def run():
        client = _aclient(cluster, timeout=HANG_S)  # a hung stream ends at it, with a timeout, not an error event
        tasks = [asyncio.create_task(one(client, i)) for i in range(4)]
        # Frozen once every stream is under way, then killed: the tiny model can decode 200 tokens in
        # well under a second, so a kill after a fixed sleep may find the streams already finished.
        deadline = time.monotonic() + HANG_S
        while min(events) == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        cluster.signal("d1", signal.SIGSTOP)
        assert min(events) > 0
        cluster.kill("d1")
        return await asyncio.gather(*tasks)

    errors = asyncio.run(run())
    # a stream that got its last token before the stop (one that began well before the last began, on a
    # loaded box) was not cut; the one that began last was
    cut = [error for error, done in zip(errors, finished, strict=True) if not done]
    assert cut, "no stream was under way when the decode worker was stopped"
    for error in cut:  # an error event from the gateway: not silence, nor the client's own timeout
        assert error is not None, "a stream cut by a dead worker must end with an error event"
        assert not isinstance(error, openai.APIConnectionError), error


def test_bad_inputs_get_clear_errors_and_workers_keep_serving(default_cluster):
    cluster = default_cluster
    url = f"{cluster.base_url}/completions"
    cases = [
        ({"model": "nope", "prompt": [1, 2]}, 404),
        ({"model": MODEL, "prompt": [1, 2], "temperature": -1}, 400),
        ({"model": MODEL, "prompt": list(range(5, 300))}, 400),
        ({"model": MODEL, "prompt": [1, 2], "max_tokens": 0}, 400),
        ({"model": MODEL, "prompt": [1, 99999]}, 400),
    ]
    with httpx.Client(timeout=30) as http:
        for body, status in cases:
            resp = http.post(url, json=body)
            assert resp.status_code == status, (body, resp.text)
            assert set(resp.json()["error"]) >= {"message", "type", "param", "code"}
        assert http.post(url, content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
        assert http.post(url, content=b"x" * (2 << 20), headers={"content-type": "application/json"}).status_code == 413
    ok = _client(cluster).completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=5,
                                             extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 5
