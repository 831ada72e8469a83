"""``kvrelay serve``, the one command: real SmolLM2-135M-Instruct behind the gateway, driven by the
``openai`` SDK (sync and async, streamed and not), in both disaggregated and unified mode; Ctrl-C
stops every process and leaves no registration behind."""

import asyncio
import os
import signal
import socket
import time

import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.redis_conn import sync_client
from tests.e2e.cluster import free_port
from tests.e2e.served import start_serve, until_ready

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", params=["disaggregated", "unified"])
def served(request, smollm2_dir, tmp_path_factory, redis_url):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    sync_client(redis_url).flushall()  # registrations left by earlier tests' killed workers
    proc = start_serve(["--port", str(port), "--redis-url", redis_url, "--max-model-len", "1024", "--mode",
                        request.param], log, dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        until_ready(proc, log)
        yield f"http://127.0.0.1:{port}/v1", proc, redis_url
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sync_chat_answers_paris(served):
    client = openai.OpenAI(base_url=served[0], api_key="none")
    model = client.models.list().data[0].id
    resp = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=32, temperature=0.0)
    assert "Paris" in resp.choices[0].message.content
    assert 0 < resp.usage.completion_tokens <= 32
    assert resp.usage.prompt_tokens > 5


def test_async_streamed_chat_answers_paris(served):
    async def run():
        client = openai.AsyncOpenAI(base_url=served[0], api_key="none")
        model = (await client.models.list()).data[0].id
        stream = await client.chat.completions.create(model=model, messages=QUESTION, max_tokens=32,
                                                      temperature=0.0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    assert "Paris" in asyncio.run(run())


def test_completion_from_token_ids(served):
    client = openai.OpenAI(base_url=served[0], api_key="none")
    model = client.models.list().data[0].id
    tok_ids = [1, 9690, 198]  # any in-vocabulary ids
    resp = client.completions.create(model=model, prompt=tok_ids, max_tokens=8, temperature=0.0,
                                     extra_body={"ignore_eos": True})
    assert resp.usage.prompt_tokens == 3 and resp.usage.completion_tokens == 8
    assert resp.choices[0].finish_reason == "length"


def test_ctrl_c_stops_everything_cleanly(served):
    _url, proc, redis_url = served
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 2
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0
    gone, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"orphans: {alive}"
    r = sync_client(redis_url)
    assert not any(r.exists(keys.worker_key(w.decode())) for w in r.smembers(keys.WORKERS_INDEX))
    assert r.scard(keys.WORKERS_INDEX) == 0


def two_free_ports() -> int:
    """A port whose next one is free too (serve gives gateway i the token-event port --zmq-port + i)."""
    for _ in range(50):
        first = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", first + 1))
            except OSError:
                continue
        return first
    raise RuntimeError("no two consecutive free ports")


def test_api_server_count_runs_gateways_that_share_the_port(tmp_path, redis_url):
    import json
    import urllib.request

    port, log, zmq_port = free_port(), tmp_path / "serve.log", two_free_ports()
    sync_client(redis_url).flushall()
    proc = start_serve(["--port", str(port), "--redis-url", redis_url, "--model", "dummy:tiny-llama",
                        "--max-model-len", "256", "--kv-cache-memory", str(16 << 20), "--api-server-count", "2",
                        "--zmq-port", str(zmq_port)], log, dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        until_ready(proc, log)
        gateways = [c for c in psutil.Process(proc.pid).children() if "gateway" in c.cmdline()]
        assert len(gateways) == 2
        # --zmq-port reached the gateways (it was once accepted by serve and dropped): one port each
        token_ports = {c.laddr.port for g in gateways for c in g.net_connections(kind="tcp")
                       if c.status == psutil.CONN_LISTEN and c.laddr.port != port}
        assert token_ports == {zmq_port, zmq_port + 1}
        # the kernel hands each new connection to one of the listeners: with 40 open, both gateways hold some
        # (all on one has odds 2**-39); a gateway owns a connection's socket once it accepted it
        conns = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(40)]
        try:
            def holders() -> set[int]:
                return {g.pid for g in gateways for c in g.net_connections(kind="tcp")
                        if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port}

            deadline = time.monotonic() + 30
            while len(holders()) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert holders() == {g.pid for g in gateways}
        finally:
            for conn in conns:
                conn.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as resp:
            model = json.load(resp)["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}).encode()
        texts = set()
        for _ in range(8):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                texts.add(json.load(resp)["choices"][0]["text"])
        assert len(texts) == 1  # greedy: the same answer whichever gateway took it
        # /metrics sums both gateways, whichever answers the scrape: each of 8 scrapes, on a connection of its own
        # (the kernel's draw of a gateway, as for the requests), counts all 8 requests, and none in flight
        done = {("vllm:request_success_total", frozenset({"model_name": model, "finished_reason": "length"}.items())),
                ("kvrelay_http_requests_total", frozenset({"route": "/v1/completions", "status": "200"}.items()))}
        live = {(name, frozenset({label: model}.items())) for name, label in (
            ("vllm:num_requests_running", "model_name"), ("vllm:num_requests_waiting", "model_name"),
            ("kvrelay_requests_in_flight", "model"))}
        for _ in range(8):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
                text = resp.read().decode()
            samples = {(s.name, frozenset(s.labels.items())): s.value
                       for family in text_string_to_metric_families(text) for s in family.samples}
            assert {key: samples.get(key) for key in done} == dict.fromkeys(done, 8.0)
            assert {key: samples.get(key) for key in live} == dict.fromkeys(live, 0.0)
            assert text.count("# TYPE kvrelay_queue_depth gauge") == 1  # the collectors reading Redis, once
            assert "process_cpu_seconds_total" not in text  # one process's series would jump between scrapes
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    assert not any(p.is_running() for p in gateways)
