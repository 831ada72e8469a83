"""Structured outputs through the workers' loops (real SmolLM2 engines, real Redis, a real ZMQ socket standing
in for the gateway): a unified worker's constrained jobs form documents that validate and a job whose
constraint does not compile gets an error event naming the field while the worker keeps serving; a decode
worker continues the grammar of a request whose first token a prefill engine sampled."""

import json
import time

import jsonschema
import pytest
import zmq

from kvrelay.shared.text.tokenizer import load_tokenizer
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire import zmq_auth
from kvrelay.shared.wire.codec import decode as decode_msg
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.protocol import Job, TokenBatch
from kvrelay.shared.wire.sampling_params import SamplingParams
from kvrelay.shared.wire.structured_outputs import StructuredOutputs
from kvrelay.unified_worker.worker import UnifiedWorker

HANG_BOUND_S = 300  # a hang bound, not a speed claim

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(params=[[], ["--async-scheduling"]], ids=["sync", "async"])
def worker(redis_url, smollm2_dir, request):
    from kvrelay.cli import build_parser
    from kvrelay.shared.wire.redis_conn import sync_client
    from kvrelay.workers import worker_config

    sync_client(redis_url).flushall()
    # the job keeper's thread does not run here (attach, not start): a job held past the reclaim idle time would
    # be reclaimed by the worker's own fetch as a failed delivery
    args = build_parser().parse_args(["unified-worker", "--model", str(smollm2_dir), "--device", "cpu",
                                      "--redis-url", redis_url, "--max-model-len", "512", "--skip-warmup",
                                      "--reclaim-idle-ms", str(HANG_BOUND_S * 1000), *request.param])
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
        # the plain job shares the constrained ones' first steps; run to 80 tokens it would outlast them alone
        params = SamplingParams(temperature=1.0, max_tokens=80 if so else 16, structured_outputs=so)
        job = Job(request_id=rid, model=slot.instance, prompt_token_ids=prompt, sampling=params, tenant="t",
                  priority=0, reply_addr=reply_addr, deadline=0.0, arrival=time.time())
        worker.runtime.redis.xadd(keys.prefill_stream(slot.instance), {keys.JOB_FIELD: encode(job)})

    tokens: dict[str, list[int]] = {rid: [] for rid in jobs}
    ends: dict[str, tuple[str, str | None]] = {}
    deadline = time.monotonic() + HANG_BOUND_S
    while len(ends) < len(jobs):
        assert time.monotonic() < deadline, ends
        worker.step()
        while gateway.poll(0):
            for event in decode_msg(gateway.recv(), TokenBatch).events:
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


def test_decode_worker_continues_the_grammar_of_a_handed_off_request(redis_url, smollm2_dir):
    """The decode side of the disaggregated path through a real decode worker: a prefill engine samples the
    first token under the schema and holds the prompt's KV; the KV goes into blocks the decode worker's
    engine reserved, the handoff header is admitted as the worker admits it (its compile starts there, and
    it keeps its seat while compiling), and the decode worker's events complete a document that validates."""
    from kvrelay.cli import build_parser
    from kvrelay.decode_worker.worker import DecodeWorker
    from kvrelay.shared.config.engine import EngineConfig, ModelConfig
    from kvrelay.shared.engine.engine_core import EngineCore
    from kvrelay.shared.handoff.blocks import layout_of
    from kvrelay.shared.wire.handoff import KVHeader
    from kvrelay.shared.wire.redis_conn import sync_client
    from kvrelay.workers import worker_config

    sync_client(redis_url).flushall()
    args = build_parser().parse_args(["decode-worker", "--model", str(smollm2_dir), "--device", "cpu",
                                      "--redis-url", redis_url, "--max-model-len", "512", "--skip-warmup"])
    config = worker_config("decode", args)
    config.freeze_gc = False
    decode = DecodeWorker(config)
    prefill = EngineCore(EngineConfig(ModelConfig(str(smollm2_dir), max_model_len=512), device="cpu"),
                         hold_finished_kv=True)
    gateway = zmq.Context.instance().socket(zmq.PULL)
    try:
        (slot,) = decode.runtime.slots.values()
        core = slot.core
        zmq_auth.serve(gateway, decode.runtime.curve)
        reply_addr = f"tcp://127.0.0.1:{gateway.bind_to_random_port('tcp://127.0.0.1')}"
        tok = load_tokenizer(smollm2_dir)
        so = StructuredOutputs(json=json.dumps(SCHEMA))
        tokens: dict[str, list[int]] = {}
        for i in range(2):
            rid = f"h{i}"
            prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": f"User {i} as JSON."}],
                                                        tokenize=False, add_generation_prompt=True))
            params = SamplingParams(temperature=1.0, max_tokens=80, structured_outputs=so)
            job = Job(request_id=rid, model=slot.instance, prompt_token_ids=prompt, sampling=params, tenant="t",
                      priority=0, reply_addr=reply_addr, deadline=time.time() + 120, arrival=time.time())
            prefill.add_request(prefill.make_request(rid, prompt, SamplingParams(
                temperature=1.0, max_tokens=1, structured_outputs=so), slot.eos_ids[0]))
            first = []
            while prefill.has_unfinished():
                first += [t for o in prefill.step() for t in o.new_token_ids]
            blocks = core.kv.reserve(rid, len(prompt))
            core.kv.kv_cache[:, :, blocks] = prefill.kv.kv_cache[:, :, prefill.kv.block_ids(rid)[:len(blocks)]]
            prefill.kv.release_held(rid)
            header = KVHeader(job=job, **layout_of(core.kv.kv_cache), num_blocks=len(blocks), block_ids=blocks,
                              transport="layers", nbytes=0, first_token_id=first[0], first_logprob=None,
                              first_top_logprobs=None, prompt_logprobs=None, num_cached_tokens=0)
            decode._admit(header)
            assert core.is_running(rid)  # seated, compiling or not
            tokens[rid] = list(first)
        ends: dict[str, str] = {}
        deadline = time.monotonic() + HANG_BOUND_S
        while len(ends) < len(tokens):
            assert time.monotonic() < deadline, ends
            decode.step()
            while gateway.poll(0):
                for event in decode_msg(gateway.recv(), TokenBatch).events:
                    tokens[event.request_id] += event.token_ids
                    if event.finish_reason is not None:
                        ends[event.request_id] = event.finish_reason
        assert ends == {"h0": "stop", "h1": "stop"}
        for ids in tokens.values():
            assert ids[-1] == slot.eos_ids[0]
            jsonschema.validate(json.loads(tok.decode(ids[:-1])), SCHEMA)
    finally:
        gateway.close(linger=0)
        decode.sock.close(linger=0)
        decode.runtime.shutdown()
