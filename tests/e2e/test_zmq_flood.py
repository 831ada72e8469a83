"""Issue #13's attack, with real processes: a local DEALER without the deployment's secret floods the decode
worker's ROUTER with forged HandoffRequests for every seat. Before CURVE, 256 of them took the whole batch
and a genuine request stalled for the grant TTL (10 s), over and over. Now the flood dies in the handshake:
no grant, no seat, nothing in the decode worker's log, and a genuine request is served as fast as before."""

import contextlib
import time

import httpx
import pytest
import zmq

from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.handoff import HandoffRequest
from kvrelay.shared.wire.redis_conn import EmbeddedRedis
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import TINY_ENGINE

FLOOD = 256
SEATS = 8
SERVED_WITHIN_S = 2.0  # generous for a 2-layer model on CI; a stall on forged grants takes the 10 s TTL


def _request_seconds(base_url: str) -> float:
    started = time.monotonic()
    resp = httpx.post(f"{base_url}/completions", json={"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 2,
                                                        "temperature": 0.0, "ignore_eos": True}, timeout=60)
    assert resp.status_code == 200, resp.text
    return time.monotonic() - started


@pytest.fixture()
def cluster(tiny_model_dir, tmp_path):
    with EmbeddedRedis() as url:
        c = Cluster(url, str(tiny_model_dir), [*TINY_ENGINE, "--max-num-seqs", str(SEATS)], tmp_path)
        c.start_worker("prefill", "p1")
        c.start_worker("decode", "d1")
        c.start_gateway()
        try:
            c.wait_ready()
            yield c
        finally:
            c.stop()


def test_a_forged_handoff_flood_from_outside_takes_no_seat_and_delays_nobody(cluster):
    before = _request_seconds(cluster.base_url)
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
            time.sleep(1.0)  # the worker's loop has had every chance to take them
            assert not evil.poll(0), "the outsider got an answer"
            during = _request_seconds(cluster.base_url)
            assert during < SERVED_WITHIN_S, f"a genuine request took {during:.1f}s during the flood " \
                                             f"(before it: {before:.2f}s)\n" + cluster.log("d1")[-2000:]
        assert cluster.worker("d1").running == 0  # no forged request holds a seat
        new_lines = cluster.log("d1").splitlines()[log_before:]
        assert len(new_lines) < 10 and not any("forged" in line for line in new_lines), new_lines[:20]
    finally:
        evil.close()
        ctx.destroy(linger=0)
