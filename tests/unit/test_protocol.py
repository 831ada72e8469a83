"""shared/wire/codec.py, protocol.py, handoff.py: every message round-trips; anything malformed is a ValueError, never a crash or a
half-built message."""

import dataclasses

import msgpack
import pytest

from kvrelay.shared.wire import codec, limits
from kvrelay.shared.wire import handoff as h
from kvrelay.shared.wire import protocol as p
from kvrelay.shared.wire.sampling_params import SamplingParams
from kvrelay.shared.wire.structured_outputs import StructuredOutputs


def _job(**over) -> p.Job:
    base = dict(request_id="r1-0", model="tiny", prompt_token_ids=[1, 2, 3],
                sampling=SamplingParams(max_tokens=8, stop=["\n"]), tenant="t", priority=0,
                reply_addr="tcp://127.0.0.1:5555", deadline=1e9, arrival=1e9 - 1, cache_salt=None)
    return p.Job(**{**base, **over})


def _header(**over) -> h.KVHeader:
    base = dict(job=_job(prompt_token_ids=[5, 6, 7]), num_layers=2, num_kv_heads=2, head_dim=8, block_size=4,
                num_blocks=2, block_ids=[7, 3], dtype="bfloat16", transport="layers", nbytes=512,
                first_token_id=9, first_logprob=-0.25, first_top_logprobs=[(9, -0.25)],
                prompt_logprobs=[None, [(6, -1.0)], [(7, -2.0), (1, -0.5)]], num_cached_tokens=0)
    return h.KVHeader(**{**base, **over})


SAMPLES = [
    _job(),
    _job(cache_salt="tenant-a"),
    p.TokenEvent("r1-0", [4, 5], [-0.5, -1.25], [[(4, -0.5), (8, -2.0)], [(5, -1.25)]],
                 prompt_logprobs=[None, [(2, -3.0), (4, -0.1)]], prompt_logprob_ranks=[None, [7, 1]],
                 finish_reason="stop", stop_reason=5,
                 num_prompt_tokens=3, num_cached_tokens=2, output_index=1, worker_id="w1"),
    p.TokenEvent("r2", finish_reason="error", error="boom"),
    p.TokenBatch(events=[p.TokenEvent("a", [1]), p.TokenEvent("b", [2], finish_reason="length")]),
    p.Abort(request_ids=["a-0", "a-1"], reason="client disconnected"),
    h.HandoffRequest("r", "m", num_tokens=10, block_size=4, device_uuid="GPU-1", requester="p1", ask=2),
    h.HandoffGrant("r", accepted=True, block_ids=[1, 2, 3], ttl_s=5.0, epoch=9, ask=2),
    h.HandoffGrant("r", accepted=False, reason="no free blocks"),
    h.HandoffRequests([h.HandoffRequest("a", "m", num_tokens=3, block_size=4), h.HandoffRequest("b", "m", 9, 4)]),
    h.HandoffGrants([h.HandoffGrant("a", accepted=True, block_ids=[7]), h.HandoffGrant("b", accepted=False)]),
    h.KVLayers("r", first=4, nbytes=1024, checksums=[1, 2]),
    _header(),
    _header(transport="ipc"),
    h.HandoffCancel("r", reason="ended at its first token"),
    h.HandoffAck("r", ok=False, reason="checksum mismatch"),
    p.WorkerInfo("w1", "decode", ["tiny"], "tcp://127.0.0.1:7", 10, 20, 1, 0, 123, "host", 1.0, 2.0),
    p.ModelInfo("tiny", "/models/tiny", 2048, 32000, [2, 32001], 16, "float32"),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = codec.encode(msg)
    assert isinstance(data, bytes)
    back = codec.decode(data, type(msg))
    assert back == msg
    assert codec.decode_any(data) == msg


def test_job_sampling_restores_sampling_params():
    job = codec.decode(codec.encode(_job()), p.Job)
    assert isinstance(job.sampling, SamplingParams)
    assert job.sampling.max_tokens == 8 and job.sampling.stop == ["\n"]


def test_the_handoff_header_carries_the_job_whole():
    header = codec.decode(codec.encode(_header()), h.KVHeader)
    assert header.job == _job(prompt_token_ids=[5, 6, 7])
    assert (header.request_id, header.model) == ("r1-0", "tiny")


def test_logit_bias_crosses_the_wire_as_two_lists():
    bias = {7042: -100.0, 0: 100, 49151: 0.5}
    raw = msgpack.unpackb(codec.encode(_job(sampling=SamplingParams(logit_bias=bias))), strict_map_key=False)
    assert raw["sampling"]["logit_bias"] == [[7042, 0, 49151], [-100.0, 100, 0.5]]
    assert codec.decode(codec.encode(_job(sampling=SamplingParams(logit_bias=bias))), p.Job).sampling.logit_bias == bias
    assert SamplingParams(logit_bias={}).logit_bias is None  # {} is no bias


@pytest.mark.parametrize("wire, why", [
    ({"7": 1.0}, "keys, values"), ({7: 1.0}, "map key"), ([[1, 2], [1.0]], "2 keys for 1"), ([[1, 1], [1.0, 2.0]], "repeated"),
    ([["1"], [1.0]], "integers"), ([[[1]], [1.0]], "integers"), ([[-1], [1.0]], "non-negative"),
    ([[1], [101.0]], r"\[-100, 100\]"), ([[1], ["x"]], "float"), ([list(range(301)), [0.0] * 301], "at most 300"),
    ([list(range(5000)), [0.0] * 5000], "at most 4096"),
])
def test_hostile_logit_bias_is_a_value_error(wire, why):
    # a worker turns a ValueError into that request's error event; anything else would take it down
    raw = msgpack.unpackb(codec.encode(_job()), strict_map_key=False)
    raw["sampling"]["logit_bias"] = wire
    with pytest.raises(ValueError, match=why):
        codec.decode(msgpack.packb(raw), p.Job)


@pytest.mark.parametrize("ranks", [[None], [None, [7]], [[1], [7, 1]], [None, None]])
def test_prompt_logprob_ranks_must_match_the_entries(ranks):
    event = p.TokenEvent("r", [1], prompt_logprobs=[None, [(2, -3.0), (4, -0.1)]], prompt_logprob_ranks=ranks)
    with pytest.raises(ValueError, match="prompt_logprob_ranks"):
        codec.decode(codec.encode(event), p.TokenEvent)


def test_structured_outputs_cross_the_wire_nested():
    so = StructuredOutputs(json='{"type":"object"}')
    job = codec.decode(codec.encode(_job(sampling=SamplingParams(structured_outputs=so))), p.Job)
    assert job.sampling.structured_outputs == so and job.sampling.structured_outputs.kind == "json"


@pytest.mark.parametrize("wire, why", [
    ({"json": "{}", "regex": "a+"}, "exactly one"), ({}, "got none"), ({"choice": []}, "choice"),
    ({"choice": ["a", ""]}, "non-empty"), ({"regex": ""}, "exactly one|non-empty"), ({"json_object": 1}, "bool"),
    ({"grammar": "x" * 300_000}, "at most"), ({"json": "{}", "extra": 1}, "extra"),
])
def test_hostile_structured_outputs_are_value_errors(wire, why):
    raw = msgpack.unpackb(codec.encode(_job()), strict_map_key=False)
    raw["sampling"]["structured_outputs"] = wire
    with pytest.raises(ValueError, match=why):
        codec.decode(msgpack.packb(raw), p.Job)


def test_structured_outputs_refuse_beam_search():
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(use_beam_search=True, max_tokens=4, structured_outputs=StructuredOutputs(regex="a+"))


def test_invalid_sampling_on_the_wire_is_a_value_error_naming_the_field():
    raw = msgpack.unpackb(codec.encode(_job()), strict_map_key=False)
    raw["sampling"]["top_p"] = 2.0
    with pytest.raises(ValueError, match="top_p"):
        codec.decode(msgpack.packb(raw), p.Job)


def test_batched_asks_and_grants_are_bounded_and_checked_inside():
    ask = h.HandoffRequest("a", "m", num_tokens=3, block_size=4)
    for bad, why in [(h.HandoffRequests([]), "1..256"), (h.HandoffRequests([ask] * 257), "1..256"),
                     (h.HandoffRequests([dataclasses.replace(ask, num_tokens=0)]), "positive"),
                     (h.HandoffGrants([]), "1..256")]:
        with pytest.raises(ValueError, match=why):
            codec.decode_any(codec.encode(bad))


def test_decode_checks_the_expected_type():
    data = codec.encode(p.Abort(request_ids=["x"]))
    with pytest.raises(ValueError, match="abort"):
        codec.decode(data, p.Job)
    with pytest.raises(ValueError):
        codec.decode_any(data, h.HandoffGrant, h.HandoffAck)
    assert isinstance(codec.decode_any(data, p.Abort, p.Job), p.Abort)


def _raw(msg) -> dict:
    return msgpack.unpackb(codec.encode(msg), raw=False)


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x92\x01", b"\x81\xa4type",  # empty, never-used byte, truncated array, truncated map
    _pack([1, 2, 3]), _pack("job"), _pack(None),  # valid msgpack but not a map
    _pack({"type": "nope"}), _pack({"no": "type"}), _pack({1: 2}),
])
def test_rejects_malformed_bytes(data):
    with pytest.raises(ValueError):
        codec.decode_any(data)


def test_rejects_non_bytes():
    with pytest.raises(ValueError):
        codec.decode("a string", p.Job)  # type: ignore[arg-type]


@pytest.mark.parametrize("field,value", [
    ("request_id", 5), ("prompt_token_ids", [1, "2"]), ("prompt_token_ids", "123"),
    ("prompt_token_ids", [1, True]),  # bool is not an int on the wire
    ("priority", 1.5), ("deadline", "soon"), ("sampling", [1]), ("sampling", {1: 2}),
    ("cache_salt", 7), ("prompt_token_ids", []), ("prompt_token_ids", [-1]),
    ("request_id", "x" * (limits.MAX_ID_LEN + 1)),
])
def test_rejects_wrong_field_types(field, value):
    raw = _raw(_job())
    raw[field] = value
    with pytest.raises(ValueError):
        codec.decode(_pack(raw), p.Job)


def test_rejects_missing_and_unknown_fields():
    raw = _raw(_job())
    del raw["reply_addr"]
    with pytest.raises(ValueError, match="missing field 'reply_addr'"):
        codec.decode(_pack(raw), p.Job)
    raw = _raw(_job())
    raw["__class__"] = "os.system"
    with pytest.raises(ValueError, match="unknown field"):
        codec.decode(_pack(raw), p.Job)


def test_job_with_n_above_one_is_rejected():
    raw = _raw(_job())
    raw["sampling"]["n"] = 2
    with pytest.raises(ValueError, match="n must be 1"):
        codec.decode(_pack(raw), p.Job)


def test_optional_fields_default_when_absent():
    raw = {"type": "token_event", "request_id": "r", "token_ids": [1]}
    event = codec.decode(_pack(raw), p.TokenEvent)
    assert event.logprobs is None and event.finish_reason is None and event.output_index == 0


@pytest.mark.parametrize("over", [
    {"finish_reason": "done"},  # not a finish reason
    {"logprobs": [-1.0]},  # one logprob for two tokens
    {"top_logprobs": [[[1, -0.1, 3]], []]},  # a triple where pairs belong
    {"top_logprobs": [[[1, "x"]], []]},
    {"error": "boom"},  # an error without finish_reason "error"
    {"output_index": -1},
    {"stop_reason": [1]},
    {"first_token_times": {"fetched": 1.0, "decoded": 2.0}},  # a stamp the gateway does not know
    {"first_token_times": {"fetched": "soon"}},
    {"first_token_times": {"fetched": 1.0}, "fetch_asked": "soon"},
    {"fetch_asked": 1.0},  # a read's issue time without the first token's stamps
])
def test_token_event_invariants(over):
    raw = {"type": "token_event", "request_id": "r", "token_ids": [1, 2], **over}
    with pytest.raises(ValueError):
        codec.decode(_pack(raw), p.TokenEvent)


def test_first_token_times_cross_the_wire_as_an_ignorable_field():
    times = {"fetched": 1e9, "step_started": 1e9 + 0.25, "sampled": 1e9 + 0.5}
    raw = msgpack.unpackb(codec.encode(p.TokenEvent(request_id="r", token_ids=[1], first_token_times=times)))
    assert raw[codec.IGNORABLE_KEY] == ["first_token_times"]  # a gateway that does not know them drops them
    raw = msgpack.unpackb(codec.encode(p.TokenEvent(request_id="r", token_ids=[1], first_token_times=times,
                                                    fetch_asked=1e9 - 0.1)))
    assert sorted(raw[codec.IGNORABLE_KEY]) == ["fetch_asked", "first_token_times"]
    assert codec.decode(codec.encode(p.TokenEvent(request_id="r", first_token_times=times)),
                        p.TokenEvent).first_token_times == times


def test_nested_event_errors_name_their_place():
    raw = {"type": "token_batch", "events": [{"request_id": "ok"}, {"request_id": 3}]}
    with pytest.raises(ValueError, match=r"events\[1\]"):
        codec.decode(_pack(raw), p.TokenBatch)


def test_worker_role_is_checked():
    raw = _raw(SAMPLES[-2])
    raw["role"] = "janitor"
    with pytest.raises(ValueError, match="role"):
        codec.decode(_pack(raw), p.WorkerInfo)
    assert codec.decode(codec.encode(SAMPLES[-2]), p.WorkerInfo).can_decode
    assert not codec.decode(codec.encode(SAMPLES[-2]), p.WorkerInfo).can_prefill


@pytest.mark.parametrize("over", [{"block_ids": [1]}, {"num_blocks": 0, "block_ids": []}, {"num_layers": 0},
                                  {"transport": "frames"}, {"nbytes": -1}])
def test_kv_header_layout_is_checked(over):
    raw = _raw(_header())
    raw.update(over)
    with pytest.raises(ValueError):
        codec.decode(_pack(raw), h.KVHeader)


def test_ext_types_are_rejected():
    raw = _raw(p.Abort(request_ids=["x"]))
    raw["reason"] = msgpack.ExtType(1, b"payload")
    with pytest.raises(ValueError):
        codec.decode(_pack(raw), p.Abort)


def test_oversize_is_rejected_both_ways():
    huge = b"\x00" * (codec.MAX_MESSAGE_BYTES + 1)
    with pytest.raises(ValueError, match="exceeds"):
        codec.decode(huge, p.Job)
    with pytest.raises(ValueError):
        codec.encode(p.Abort(request_ids=["x" * 1000] * (codec.MAX_MESSAGE_BYTES // 1000 + 10)))
    # A string over the per-string bound is refused by the unpacker itself.
    raw = _raw(p.Abort(request_ids=["x"]))
    raw["reason"] = "y" * (codec.MAX_STR_LEN + 1)
    with pytest.raises(ValueError):
        codec.decode(_pack(raw), p.Abort)


def test_encode_refuses_non_messages():
    with pytest.raises(TypeError):
        codec.encode({"type": "job"})

    @dataclasses.dataclass
    class Imposter:
        TAG = "job"

    with pytest.raises(TypeError):
        codec.encode(Imposter())


def test_handoff_messages_join_the_codec_once():
    assert codec.decode_any(codec.encode(h.HandoffCancel("r"))) == h.HandoffCancel("r")
    with pytest.raises(ValueError, match="taken"):
        codec.register(dataclasses.make_dataclass("Impostor", [], namespace={"TAG": "handoff_ack"}))
    codec.register(h.HandoffAck)  # the same class again is no conflict


def test_multi_model_messages_round_trip_with_nested_messages():
    from kvrelay.shared.wire.codec import decode, encode
    from kvrelay.shared.wire.protocol import (
        ControlCommand,
        ControlResult,
        InstanceStatus,
        ModelSpec,
        WorkerInfo,
        instance_key,
    )

    status = InstanceStatus(instance="m@2", name="m", version=2, state="draining", kv_blocks=7, error="")
    info = WorkerInfo(worker_id="w", role="decode", models=["m@2"], zmq_addr="tcp://h:1", free_blocks=1,
                      total_blocks=2, running=0, waiting=0, pid=1, host="h", started=0.0, heartbeat=1.0,
                      instances=[status], weights_budget=10, weights_used=5, kv_pool_bytes=8, can_load=True)
    assert decode(encode(info), WorkerInfo) == info
    cmd = ControlCommand(command_id="c", op="load", name="m", version=2, prefer_evict=["x@1"])
    assert decode(encode(cmd), ControlCommand) == cmd and cmd.instance == "m@2"
    res = ControlResult(command_id="c", worker_id="w", instance="m@2", ok=False, error="no room", evicted=["a"])
    assert decode(encode(res), ControlResult) == res
    spec = ModelSpec(name="m", version=3, pinned=True, previous_version=2)
    assert decode(encode(spec), ModelSpec) == spec and spec.instance == instance_key("m", 3) == "m@3"
    assert instance_key("m", 0) == "m"
    with pytest.raises(ValueError):
        decode(encode(ControlCommand(command_id="c", op="load", name="m")).replace(b"load", b"nuke"), ControlCommand)


def test_none_defaults_stay_off_the_wire():
    """A None that is the field's default is not sent (the decoder's default restores it): most of a
    TokenEvent is None, and each entry cost both ends. A required field that is None is still sent."""
    event = p.TokenEvent(request_id="r", token_ids=[5], output_index=3)
    raw = msgpack.unpackb(codec.encode(event))
    assert {"logprobs", "top_logprobs", "prompt_logprobs", "finish_reason", "stop_reason", "error"}.isdisjoint(raw)
    assert codec.decode(codec.encode(event), p.TokenEvent) == event
    header = _header(first_logprob=None)
    assert msgpack.unpackb(codec.encode(header))["first_logprob"] is None
    assert codec.decode(codec.encode(header), h.KVHeader) == header
