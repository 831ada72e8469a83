"""Structured outputs through a unified worker's loop (real SmolLM2 engine, real Redis, a real ZMQ socket
standing in for the gateway): a constrained job's tokens form a document that validates, and a job whose
constraint does not compile gets an error event naming the field, while the worker keeps serving."""

import json
import time

import jsonschema
import pytest
import zmq

from kvrelay.shared.text.tokenizer import load_tokenizer
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire import zmq_auth
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.protocol import Job, TokenBatch
from kvrelay.shared.wire.sampling_params import SamplingParams
from kvrelay.shared.wire.structured_outputs import StructuredOutputs
from kvrelay.unified_worker.worker import UnifiedWorker

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(params=[[], ["--async-scheduling"]], ids=["sync", "async"])
def worker(redis_url, smollm2_dir, request):
    from kvrelay.cli import build_parser
    from kvrelay.shared.wire.redis_conn import sync_client
    from kvrelay.workers import worker_config

    sync_client(redis_url).flushall()
    args = build_parser().parse_args(["unified-worker", "--model", str(smollm2_dir), "--device", "cpu",
                                      "--redis-url", redis_url, "--max-model-len", "512", "--skip-warmup",
                                      *request.param])
    config = worker_config("unified", args)
    config.freeze_gc = False  # a test process is not a worker's own
    w = UnifiedWorker(config)
    (slot,) = w.runtime.slots.values()
    w.attach(slot)  # what runtime.start does, without its threads and signal handlers
    yield w
    w.runtime.shutdown()


def test_worker_serves_constrained_jobs_and_fails_a_bad_one_alone(worker, smollm2_dir):
    (slot,) = worker.runtime.slots.values()
    tok = load_tokenizer(smollm2_dir)
    gateway = zmq.Context.instance().socket(zmq.PULL)
    zmq_auth.serve(gateway, worker.runtime.curve)
    reply_addr = f"tcp://127.0.0.1:{gateway.bind_to_random_port('tcp://127.0.0.1')}"
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "A user as JSON."}], tokenize=False,
                                                add_generation_prompt=True))
    good = StructuredOutputs(json=json.dumps(SCHEMA))
    bad = StructuredOutputs(grammar="root ::= missing_rule")
    jobs = {"good0": good, "bad": bad, "good1": good, "plain": None}
    for rid, so in jobs.items():
        params = SamplingParams(temperature=1.0, max_tokens=80, structured_outputs=so)
        job = Job(request_id=rid, model=slot.instance, prompt_token_ids=prompt, sampling=params, tenant="t",
                  priority=0, reply_addr=reply_addr, deadline=0.0, arrival=time.time())
        worker.runtime.redis.xadd(keys.prefill_stream(slot.instance), {keys.JOB_FIELD: encode(job)})

    tokens: dict[str, list[int]] = {rid: [] for rid in jobs}
    ends: dict[str, tuple[str, str | None]] = {}
    deadline = time.monotonic() + 120  # does not hang
    while len(ends) < len(jobs):
        assert time.monotonic() < deadline, ends
        worker.step()
        while gateway.poll(0):
            for event in decode(gateway.recv(), TokenBatch).events:
                tokens[event.request_id] += event.token_ids
                if event.finish_reason is not None:
                    ends[event.request_id] = (event.finish_reason, event.error)
    gateway.close(linger=0)

    assert ends["bad"][0] == "error"
    assert ends["bad"][1].startswith("structured_outputs.grammar does not compile: "), ends["bad"]
    eos = slot.eos_ids[0]
    for rid in ("good0", "good1"):
        assert ends[rid] == ("stop", None)
        assert tokens[rid][-1] == eos
        jsonschema.validate(json.loads(tok.decode(tokens[rid][:-1])), SCHEMA)
    assert ends["plain"][0] in ("stop", "length") and tokens["plain"]
    assert worker.runtime.redis.xpending(keys.prefill_stream(slot.instance), keys.PREFILL_GROUP)["pending"] == 0
