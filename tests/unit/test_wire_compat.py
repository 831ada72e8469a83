"""Rolling upgrades through shared/wire/codec.py and version.py: a field equal to its default stays off the wire;
an unknown field its sender declared ignorable is dropped, any other is refused naming it and the newer sender;
peers more than one protocol version apart are refused. Every other check of a field still holds."""

import dataclasses
from typing import ClassVar

import msgpack
import pytest

from kvrelay.shared.wire import codec, limits
from kvrelay.shared.wire import handoff as h
from kvrelay.shared.wire import protocol as p
from kvrelay.shared.wire.version import PROTOCOL_VERSION, version_refusal


def _raw(msg) -> dict:
    return msgpack.unpackb(codec.encode(msg), raw=False)


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _ask(**over) -> h.HandoffRequest:
    return h.HandoffRequest(**{"request_id": "r", "model": "m", "num_tokens": 10, "block_size": 4, **over})


def _worker(**over) -> p.WorkerInfo:
    base = dict(worker_id="w1", role="decode", models=["m"], zmq_addr="tcp://127.0.0.1:7", free_blocks=10,
                total_blocks=20, running=1, waiting=0, pid=123, host="host", started=1.0, heartbeat=2.0)
    return p.WorkerInfo(**{**base, **over})


def test_fields_equal_to_their_default_stay_off_the_wire():
    """A newer sender not using a feature sends nothing of it, so an older peer reads it as ever."""
    raw = _raw(_ask())
    assert set(raw) == {"type", "request_id", "model", "num_tokens", "block_size", "protocol"}
    raw = _raw(h.HandoffGrant("r", accepted=True, block_ids=[1], epoch=3))
    assert {"reason", "busy", "ttl_s", "targets", "frames_addr", "frames_key", "ask", "ipc"}.isdisjoint(raw)
    assert codec.decode(codec.encode(_ask()), h.HandoffRequest) == _ask()


def test_the_ignorable_fields_sent_are_named_and_must_understand_ones_are_not():
    raw = _raw(_ask(ask=2, kv_scales="abc", device_uuid="GPU-1"))
    assert sorted(raw[codec.IGNORABLE_KEY]) == ["ask", "device_uuid"]
    assert raw["kv_scales"] == "abc" and raw["ask"] == 2
    assert codec.IGNORABLE_KEY not in _raw(_ask(kv_scales="abc"))  # none sent: no list


def test_an_unknown_ignorable_field_is_dropped():
    raw = _raw(_ask(ask=2))
    raw["priority_hint"] = 7
    raw[codec.IGNORABLE_KEY].append("priority_hint")
    assert codec.decode(_pack(raw), h.HandoffRequest) == _ask(ask=2)


def test_an_unknown_must_understand_field_is_refused_naming_it_and_the_newer_sender():
    raw = _raw(_ask(ask=2))
    raw["kv_zero_point"] = "xyz"  # a feature this process cannot honour: refused, never run wrong
    raw["also_new"] = 1
    with pytest.raises(ValueError, match=r"HandoffRequest: unknown field\(s\) also_new, kv_zero_point that must be "
                                         r"understood: the sender speaks a newer wire protocol"):
        codec.decode(_pack(raw), h.HandoffRequest)


def test_nested_maps_carry_their_own_list():
    status = p.InstanceStatus(instance="m", name="m", version=0, state="ready", idle_s=3.0)
    raw = _raw(_worker(instances=[status]))
    assert raw["instances"][0][codec.IGNORABLE_KEY] == ["idle_s"]
    raw["instances"][0]["warmth"] = 0.5
    raw["instances"][0][codec.IGNORABLE_KEY].append("warmth")
    assert codec.decode(_pack(raw), p.WorkerInfo) == _worker(instances=[status])
    raw["instances"][0]["shard_map"] = [1, 2]
    with pytest.raises(ValueError, match=r"WorkerInfo\.instances\[0\]: unknown field\(s\) shard_map"):
        codec.decode(_pack(raw), p.WorkerInfo)


def test_a_field_listed_ignorable_that_this_process_knows_is_still_checked():
    raw = _raw(_ask(ask=2))
    raw["ask"] = "two"
    with pytest.raises(ValueError, match=r"\.ask"):
        codec.decode(_pack(raw), h.HandoffRequest)
    raw = _raw(_ask(ask=2))
    raw["device_uuid"] = "x" * (limits.MAX_ID_LEN + 1)
    raw[codec.IGNORABLE_KEY].append("device_uuid")
    with pytest.raises(ValueError, match="longer than"):
        codec.decode(_pack(raw), h.HandoffRequest)


@pytest.mark.parametrize("listed", ["ask", [1], {"ask": 1}])
def test_a_malformed_list_is_refused(listed):
    raw = _raw(_ask(ask=2))
    raw[codec.IGNORABLE_KEY] = listed
    with pytest.raises(ValueError, match="list of field names"):
        codec.decode(_pack(raw), h.HandoffRequest)


def test_an_ignorable_field_needs_a_default():
    @dataclasses.dataclass
    class Careless:
        TAG: ClassVar[str] = "careless_compat_test"
        hint: int = dataclasses.field(metadata=limits.IGNORABLE)

    with pytest.raises(TypeError, match="needs a default"):
        codec.register(Careless)


def test_the_protocol_version_travels_and_its_absence_reads_as_zero():
    assert _raw(_worker())["protocol"] == _raw(_ask())["protocol"] == PROTOCOL_VERSION
    assert _raw(h.HandoffGrant("r", accepted=False))["protocol"] == PROTOCOL_VERSION
    raw = _raw(_worker())
    del raw["protocol"]  # a worker from before versions were sent
    assert codec.decode(_pack(raw), p.WorkerInfo).protocol == 0


def test_peers_one_version_apart_are_served_and_further_ones_refused():
    assert version_refusal(PROTOCOL_VERSION, "w") == ""
    assert version_refusal(PROTOCOL_VERSION + 1, "w") == version_refusal(PROTOCOL_VERSION - 1, "w") == ""
    why = version_refusal(PROTOCOL_VERSION + 2, "worker 'w'")
    assert why.startswith(f"worker 'w' speaks wire protocol {PROTOCOL_VERSION + 2}, this process {PROTOCOL_VERSION}")
    assert "more than 1 version apart" in why


def test_a_job_carries_its_gateways_version_as_an_ignorable_field_left_off_at_protocol_1():
    """Jobs carried no version through protocol 1: a missing one is 1, so a protocol-1 gateway sends nothing a
    worker from before the field would refuse, and a later one sends it as ignorable."""
    job = p.Job(request_id="r", model="m", prompt_token_ids=[1], sampling=p.SamplingParams(), tenant="t", priority=0,
                reply_addr="tcp://127.0.0.1:1", deadline=2.0, arrival=1.0)
    raw = _raw(dataclasses.replace(job, protocol=1))
    assert "protocol" not in raw and codec.decode(_pack(raw), p.Job).protocol == 1
    raw = _raw(dataclasses.replace(job, protocol=2))
    assert raw["protocol"] == 2 and raw[codec.IGNORABLE_KEY] == ["protocol"]
    assert codec.decode(_pack(raw), p.Job).protocol == 2
