"""A prefill worker's job queue of this version reading the jobs of a gateway of the next one, against a real
Redis: an extra field declared ignorable is dropped and the job runs; an unknown must-understand field (a
feature this worker cannot honour) dead-letters the job and tells its client why at once, never runs it, and so
does a job of a gateway more than one protocol version apart."""

import dataclasses
import logging

import msgpack
import pytest

from kvrelay.shared.wire import job_queue
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import IGNORABLE_KEY, encode
from kvrelay.shared.wire.redis_conn import sync_client
from kvrelay.shared.wire.version import PROTOCOL_VERSION
from tests.integration.job_queue_harness import MODEL, make_job, make_queue


@pytest.fixture()
def r(redis_url):
    client = sync_client(redis_url)
    client.flushall()
    return client


def _newer_job(rid: str, sampling: dict, ignorable: bool) -> bytes:
    raw = msgpack.unpackb(encode(make_job(rid)))
    raw["sampling"].update(sampling)
    if ignorable:
        raw["sampling"][IGNORABLE_KEY] = list(sampling)
    return msgpack.packb(raw, use_bin_type=True)


def test_a_newer_job_runs_without_its_ignorable_field_and_fails_loudly_on_a_must_understand_one(r):
    told = []
    q = make_queue(r, "w", idle_ms=60_000, on_dead=lambda rid, addr, why: told.append((rid, addr, why)))
    r.xadd(keys.prefill_stream(MODEL), {keys.JOB_FIELD: _newer_job("hinted", {"cost_hint": 3}, ignorable=True)})
    r.xadd(keys.prefill_stream(MODEL), {keys.JOB_FIELD: _newer_job("strict", {"dry_run": True}, ignorable=False)})
    got = q.fetch(5, block_ms=10)
    assert [(j.request_id, j.sampling) for _, j in got] == [("hinted", make_job("hinted").sampling)]
    (dead,) = r.xrange(keys.dead_letter_stream(MODEL))
    assert b"unknown field(s) dry_run that must be understood" in dead[1][b"reason"]
    (rid, addr, why), = told
    assert (rid, addr) == ("strict", make_job("strict").reply_addr)
    assert why.startswith("this worker cannot run the job: Job.sampling: unknown field(s) dry_run") and "newer" in why


def _job_of_gateway(rid: str, protocol: int, reply_addr: str) -> bytes:
    return encode(dataclasses.replace(make_job(rid), protocol=protocol, reply_addr=reply_addr))


def test_a_job_of_a_gateway_two_versions_apart_is_refused_to_its_client_acked_and_logged_once_per_gateway(r, caplog):
    told = []
    q = make_queue(r, "w", idle_ms=0, on_dead=lambda rid, addr, why: told.append((rid, addr, why)))
    far_a, far_b, near = "tcp://127.0.0.1:11", "tcp://127.0.0.1:12", "tcp://127.0.0.1:13"
    for rid, protocol, addr in (("same", PROTOCOL_VERSION, near), ("next", PROTOCOL_VERSION + 1, near),
                                ("a1", PROTOCOL_VERSION + 2, far_a), ("a2", PROTOCOL_VERSION + 2, far_a),
                                ("b1", PROTOCOL_VERSION + 3, far_b)):
        r.xadd(keys.prefill_stream(MODEL), {keys.JOB_FIELD: _job_of_gateway(rid, protocol, addr)})
    with caplog.at_level(logging.WARNING, logger=job_queue.__name__):
        got = q.fetch(10, block_ms=10)
        assert q.fetch(10, block_ms=10) == []  # reclaim_idle_ms 0: a refused job left pending would come back
    assert [j.request_id for _, j in got] == ["same", "next"]
    assert [(rid, addr) for rid, addr, _ in told] == [("a1", far_a), ("a2", far_a), ("b1", far_b)]
    assert told[0][2] == (f"this worker cannot run the job: the gateway at {far_a} speaks wire protocol "
                          f"{PROTOCOL_VERSION + 2}, this process {PROTOCOL_VERSION}: more than 1 version apart, "
                          "refused (upgrade one version at a time)")
    assert r.xpending(keys.prefill_stream(MODEL), keys.PREFILL_GROUP)["pending"] == 2  # only the two running
    assert len(r.xrange(keys.dead_letter_stream(MODEL))) == 3
    warned = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert [w for w in warned if w.startswith("refusing the jobs of")] == [
        f"refusing the jobs of the gateway at {far_a} speaks wire protocol {PROTOCOL_VERSION + 2}, this process "
        f"{PROTOCOL_VERSION}: more than 1 version apart, refused (upgrade one version at a time)",
        f"refusing the jobs of the gateway at {far_b} speaks wire protocol {PROTOCOL_VERSION + 3}, this process "
        f"{PROTOCOL_VERSION}: more than 1 version apart, refused (upgrade one version at a time)"]
    assert len(warned) == 2  # the second job of far_a is dead-lettered without another warning


def test_far_gateways_are_remembered_up_to_a_bound_the_least_recently_refused_forgotten_first(r, caplog, monkeypatch):
    """Gateways restart under new reply addresses: the memory of whom it warned about stays bounded, and a gateway
    still sending jobs stays remembered, so its warning still comes once."""
    monkeypatch.setattr(job_queue, "FAR_GATEWAYS_KEPT", 2)
    q = make_queue(r, "w", idle_ms=60_000)
    order = ["a", "b", "a", "c", "a", "b", "a"]  # c pushes b out (a was refused after b); b comes back: warned again
    for i, gateway in enumerate(order):
        r.xadd(keys.prefill_stream(MODEL), {keys.JOB_FIELD: _job_of_gateway(f"{gateway}{i}", PROTOCOL_VERSION + 2,
                                                                            f"tcp://{gateway}:1")})
    with caplog.at_level(logging.WARNING, logger=job_queue.__name__):
        assert q.fetch(10, block_ms=10) == []
    warned = [rec.getMessage().split()[7] for rec in caplog.records if rec.getMessage().startswith("refusing")]
    assert warned == ["tcp://a:1", "tcp://b:1", "tcp://c:1", "tcp://b:1"]
    assert len(r.xrange(keys.dead_letter_stream(MODEL))) == len(order)  # every job refused, warned or not
