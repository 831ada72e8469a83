"""Issue #13's attack, with real processes: a local DEALER without the deployment's secret floods the decode
worker's ROUTER with forged HandoffRequests for every seat. Before CURVE, 256 of them took the whole batch
and a genuine request stalled for the grant TTL (10 s), over and over. Now the flood dies in the handshake:
no grant, no seat, nothing in the decode worker's log, and a genuine request gets its decode seat at once:
its handoff is never refused for want of one (the prefill worker's kvrelay_handoff_seat_wait_seconds)."""

import contextlib

import httpx
import pytest
import zmq

from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.handoff import HandoffRequest
from kvrelay.shared.wire.redis_conn import EmbeddedRedis
from tests.e2e.cluster import Cluster, free_port
from tests.e2e.conftest import TINY_ENGINE
from tests.e2e.handoff_metrics import by_label, handoffs_settled

FLOOD = 256
SEATS = 8
NO_ANSWER_MS = 1000  # how long the outsider listens for an answer that must never come
SEAT_WAITS = "kvrelay_handoff_seat_wait_seconds_count"


def _served(base_url: str) -> None:
    resp = httpx.post(f"{base_url}/completions", json={"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 2,
                                                        "temperature": 0.0, "ignore_eos": True}, timeout=120)
    assert resp.status_code == 200, resp.text


def _seat_waits(cluster: Cluster, handoffs: int) -> float:
    """Handoffs refused for want of a decode seat, once the prefill worker has counted ``handoffs`` (it counts
    one when it reads the decode worker's ack, which may come after the client has its answer)."""
    port = cluster.metrics_ports["p1"]
    assert sum(handoffs_settled(port, "transport", handoffs, bound_s=60).values()) >= handoffs
    waits = by_label(port, SEAT_WAITS, "model_name")
    assert waits, f"p1 exposes no {SEAT_WAITS}"  # or the comparison below would hold for any flood
    return sum(waits.values())


@pytest.fixture()
def cluster(tiny_model_dir, tmp_path):
    with EmbeddedRedis() as url:
        c = Cluster(url, str(tiny_model_dir), [*TINY_ENGINE, "--max-num-seqs", str(SEATS)], tmp_path)
        c.metrics_ports = {"p1": free_port()}
        c.start_worker("prefill", "p1", ["--monitoring-port", str(c.metrics_ports["p1"])])
        c.start_worker("decode", "d1")
        c.start_gateway()
        try:
            c.wait_ready()
            yield c
        finally:
            c.stop()


def test_a_forged_handoff_flood_from_outside_takes_no_seat_and_delays_nobody(cluster):
    _served(cluster.base_url)
    waits_before = _seat_waits(cluster, handoffs=1)
    d1 = cluster.worker("d1")
    log_before = cluster.log("d1").count("\n")
    ctx = zmq.Context()
    evil = ctx.socket(zmq.DEALER)
    evil.setsockopt(zmq.LINGER, 0)
    evil.connect(d1.zmq_addr)
    try:
        for round_ in range(2):  # again once the first grants would have expired: the stall was forever
            for i in range(FLOOD):
                with contextlib.suppress(zmq.Again):  # no handshake, no pipe: libzmq drops what it cannot send
                    evil.send(encode(HandoffRequest(f"forged-{round_}-{i}", d1.models[0], num_tokens=8,
                                                    block_size=8)), zmq.NOBLOCK)
            # the genuine request's handoff goes through the decode worker's loop after the flood was sent;
            # a forged request that got in would hold a seat it needs, or be answered (grant or refusal)
            _served(cluster.base_url)
            assert not evil.poll(NO_ANSWER_MS), "the outsider got an answer"
        assert _seat_waits(cluster, handoffs=3) == waits_before, "a genuine handoff waited for a decode seat\n" \
            + cluster.log("d1")[-2000:]
        new_lines = cluster.log("d1").splitlines()[log_before:]
        assert len(new_lines) < 10 and not any("forged" in line for line in new_lines), new_lines[:20]
    finally:
        evil.close()
        ctx.destroy(linger=0)
