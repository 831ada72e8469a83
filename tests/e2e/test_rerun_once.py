"""A decode worker killed with -9 after telling the gateway it holds a request and before acking its KV to
the prefill worker: both the gateway (the holder its events named is gone) and the prefill worker (its
transfer never acked) see the death, and each would run the request again. Exactly one does
(shared/wire/rerun.py): the streamed client sees every token once and the request completes once.

The decode worker is held in that window by its test-only switch (decode_worker/worker.py,
``KVRELAY_TEST_HOLD_BEFORE_ACK``); the other has fewer KV blocks, so the prefill worker picks the held one
first.

And one killed after its ack whose own events never reached the gateway (its first event to a gateway waits
for the connection's handshake; here a prelude drops them all): the prefill worker names it on the ack, so the
gateway still knows whose death to watch for and re-runs the request, where it would otherwise wait out the
request's deadline."""

import concurrent.futures
import re
import time

import openai
import pytest

from kvrelay import SamplingParams
from kvrelay.decode_worker.worker import TEST_HOLD_BEFORE_ACK_ENV
from kvrelay.shared.wire import redis_keys as keys
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import TINY_ENGINE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PROMPT = "The capital of France is"
MAX_TOKENS = 24
PREFILL_RERUNS = "its job goes back to the stream"
PREFILL_LEAVES_IT = "its gateway queued it again already"
# Python run in the decode worker before its CLI: every event it sends a gateway is lost on the way
EVENTS_LOST = """
from kvrelay.shared.worker.event_sink import EventSink
EventSink.flush = lambda self: self.pending.clear()
"""


def test_a_decode_worker_killed_between_announcing_and_acking_is_re_run_once(tiny_model_dir, tiny_offline, redis_url,
                                                                              tmp_path, monkeypatch):
    want = tiny_offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                        ignore_eos=True))[0].outputs[0].text
    held = tmp_path / "held"
    cluster = Cluster(redis_url, str(tiny_model_dir), TINY_ENGINE, tmp_path)
    cluster.redis.flushall()
    try:
        cluster.start_gateway()
        # a handoff timeout longer than the death takes to show (the registration's TTL, then GONE_AFTER_S)
        cluster.start_worker("prefill", "p1", ["--handoff-timeout", "60"])
        monkeypatch.setenv(TEST_HOLD_BEFORE_ACK_ENV, str(held))
        cluster.start_worker("decode", "d1")
        monkeypatch.delenv(TEST_HOLD_BEFORE_ACK_ENV)
        cluster.start_worker("decode", "d2", ["--num-gpu-blocks-override", "1024"])
        cluster.wait_ready(timeout=240)
        client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0, timeout=120)

        def ask() -> list:
            stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                               stream=True, extra_body={"ignore_eos": True})
            return [c.choices[0] for c in stream if c.choices]

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(ask)
            deadline = time.monotonic() + 120
            while not held.exists():
                assert not answer.done(), answer.result()
                assert time.monotonic() < deadline, cluster.log("d1")[-3000:]
                time.sleep(0.1)
            cluster.kill("d1")
            chunks = answer.result(timeout=180)
        # the prefill worker sees the death a few seconds after the gateway does (GONE_AFTER_S): its decision
        deadline = time.monotonic() + 60
        while not any(line in cluster.log("p1") for line in (PREFILL_RERUNS, PREFILL_LEAVES_IT)):
            assert time.monotonic() < deadline, cluster.log("p1")[-3000:]
            time.sleep(0.2)
        gateway, prefill, other = cluster.log("gateway"), cluster.log("p1"), cluster.log("d2")
    finally:
        cluster.stop()
    assert "".join(c.text for c in chunks) == want  # every token once, in order
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]  # completed once
    by_gateway = sum(int(n) for n in re.findall(r"(\d+) job\(s\) queued again", gateway))
    by_prefill = prefill.count(PREFILL_RERUNS)
    assert by_gateway + by_prefill == 1, (gateway[-3000:], prefill[-3000:])
    if by_gateway:  # the prefill worker saw the death too, and left the re-run to the gateway
        assert PREFILL_LEAVES_IT in prefill
    assert "duplicate request id" not in prefill + other


def test_a_decode_worker_whose_events_never_left_is_watched_from_the_ack_and_re_run(tiny_model_dir, tiny_offline,
                                                                                      redis_url, tmp_path):
    want = tiny_offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                        ignore_eos=True))[0].outputs[0].text
    cluster = Cluster(redis_url, str(tiny_model_dir), TINY_ENGINE, tmp_path)
    cluster.redis.flushall()
    try:
        cluster.start_gateway()
        cluster.start_worker("prefill", "p1")
        cluster.start_worker("decode", "d1", prelude=EVENTS_LOST)
        cluster.start_worker("decode", "d2", ["--num-gpu-blocks-override", "1024"])  # fewer blocks: d1 goes first
        cluster.wait_ready(timeout=240)
        client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0, timeout=120)
        stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = [next(stream).choices[0]]  # the first token, from p1
        # p1 XACKs the job once d1 acked its KV: from then on only the gateway can re-run it
        stream_key = keys.prefill_stream("tiny")
        deadline = time.monotonic() + 60
        while cluster.redis.xpending(stream_key, keys.PREFILL_GROUP)["pending"]:
            assert time.monotonic() < deadline, cluster.log("p1")[-3000:]
            time.sleep(0.05)
        cluster.kill("d1")
        chunks += [c.choices[0] for c in stream if c.choices]
        gateway = cluster.log("gateway")
    finally:
        cluster.stop()
    assert "".join(c.text for c in chunks) == want  # the re-run on d2 continued the same text
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]
    assert "decode worker d1 stopped; 1 job(s) queued again" in gateway, gateway[-3000:]
