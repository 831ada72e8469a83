"""The gateway's side of priority bands (shared/wire/priority_bands.py), against real Redis, real ZMQ and the fake
worker publishing --scheduling-policy priority: each job is queued in its priority's band stream, and
--max-queue-depth counts every band. (Under first come, first served a priority is still refused and a job
still goes to the shared stream: test_gateway.py.)"""

import time

import openai
import pytest

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.priority_bands import BANDS, band_stream
from kvrelay.shared.wire.protocol import Job
from kvrelay.shared.wire.redis_conn import sync_client
from kvrelay.shared.wire.sampling_params import SamplingParams
from tests.integration.gateway_harness import MODEL, running_stack

pytestmark = pytest.mark.timeout(120)
MAX_QUEUE_DEPTH = 4  # the first test queues as many


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("bands"), scheduling_policy="priority",
                       max_queue_depth=MAX_QUEUE_DEPTH) as s:
        yield s


@pytest.fixture
def r(stack):
    """The stack's Redis, its band streams emptied (the fake worker ACKs its jobs but leaves them in the stream,
    so each request's job stays there, counted by the gateway as queued)."""
    client = sync_client(stack.redis_url)
    for band in BANDS:
        client.xtrim(band_stream(MODEL, band), maxlen=0)
    yield client
    client.close()


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


def _streams_of(r) -> dict[str, int]:
    """request id -> the band whose stream holds its job."""
    return {decode(fields[keys.JOB_FIELD.encode()], Job).request_id.split("-")[0]: band
            for band in BANDS for _, fields in r.xrange(band_stream(MODEL, band))}


def test_each_job_is_queued_in_its_prioritys_band(stack, r):
    sent = {}
    for priority in (-7, -1, 0, 2):
        out = _client(stack).completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                                extra_body={"priority": priority})
        assert out.choices[0].text
        sent[out.id.split("-", 1)[1]] = priority
    assert _streams_of(r) == {rid: max(-2, min(2, priority)) for rid, priority in sent.items()}


def test_the_queue_depth_bound_counts_every_band(stack, r):
    silent = stack.tokenizer.encode("[silent]")  # the fake worker takes these and never answers
    for i in range(MAX_QUEUE_DEPTH):
        job = Job(request_id=f"waiting{i}", model=MODEL, prompt_token_ids=silent, sampling=SamplingParams(max_tokens=2),
                  tenant="default", priority=2, reply_addr="tcp://127.0.0.1:1", deadline=time.time() + 60,
                  arrival=time.time())
        r.xadd(band_stream(MODEL, 2), {keys.JOB_FIELD: encode(job)})
    with pytest.raises(openai.RateLimitError) as refused:
        _client(stack).completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"priority": -1})
    assert refused.value.code == "queue_full"
