"""A unified worker's engine, alone behind a gateway (its own module: another module's workers on the same
Redis would serve part of its requests), reports all four of vLLM's request phases for each request
through the gateway's ``/metrics``, equal to the worker's own scrape."""

import time

import openai
import pytest

from tests.e2e.cluster import Cluster, free_port
from tests.e2e.conftest import TINY_ENGINE
from tests.e2e.test_api_metrics import MAX_TOKENS, MODEL, PHASES, gateway, value, worker

pytestmark = pytest.mark.slow


def test_a_unified_engine_reports_every_phase_of_its_requests(tiny_model_dir, redis_url, tmp_path):
    c = Cluster(redis_url, str(tiny_model_dir), TINY_ENGINE, tmp_path)
    c.redis.flushall()
    c.metrics_ports = {"u1": free_port()}
    c.start_gateway()
    c.start_worker("unified", "u1", ["--monitoring-port", str(c.metrics_ports["u1"])])
    try:
        c.wait_ready()
        client = openai.OpenAI(base_url=c.base_url, api_key="none", max_retries=0)
        for prompt in ("One", "Two"):
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                      extra_body={"ignore_eos": True})
        deadline = time.monotonic() + 60
        while True:
            snap = gateway(c)
            counts = {p: value(snap, f"vllm:request_{p}_time_seconds_count", engine="u1") for p in PHASES}
            if counts == {p: 2 for p in PHASES} or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert counts == {p: 2 for p in PHASES}  # one engine sees the whole request, as vLLM's does
        own = worker(c, "u1")
        instance = next(labels for (n, labels) in own if n == "vllm:request_inference_time_seconds_sum")
        # the worker labels its series with the instance, the gateway with the served name
        assert value(snap, "vllm:request_inference_time_seconds_sum", engine="u1") == own[
            ("vllm:request_inference_time_seconds_sum", instance)]
        assert value(snap, "vllm:request_inference_time_seconds_sum", engine="u1") >= value(
            snap, "vllm:request_decode_time_seconds_sum", engine="u1")
    finally:
        c.stop()
