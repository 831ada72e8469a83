"""Token events never block an engine step: a gateway that stops reading loses only its own events (and
is named, so its requests can be aborted); every other gateway still gets all of its own."""

import time

import pytest
import zmq

from kvrelay.shared.wire import zmq_auth
from kvrelay.shared.wire.codec import decode
from kvrelay.shared.wire.protocol import TokenBatch, TokenEvent
from kvrelay.shared.worker.event_sink import EventSink
from tests.zmq_secret import CURVE

STEPS = 4000  # far past what the send queue and the kernel's socket buffers of the stuck gateway hold


def pull(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    zmq_auth.serve(sock, CURVE)  # as the gateway's
    return sock, f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"


@pytest.mark.timeout(120)
def test_a_gateway_that_never_reads_blocks_no_flush_and_others_get_every_event():
    ctx = zmq.Context()
    stuck, stuck_addr = pull(ctx)  # never read
    live, live_addr = pull(ctx)
    sink = EventSink(ctx, curve=CURVE)
    payload = list(range(128, 2128))  # a few kB a batch, so the stuck gateway's buffers fill in ~1k steps
    received: list[int] = []
    stalled: list[str] = []
    try:
        for step in range(STEPS):
            sink.add(stuck_addr, TokenEvent(request_id="stuck", token_ids=payload, output_index=step))
            sink.add(live_addr, TokenEvent(request_id="live", token_ids=[step], output_index=step))
            sink.flush()  # one blocked send to the stuck gateway would block here for good: the mark times out
            stalled += sink.take_stalled()
            while live.poll(0):
                received += [e.output_index for e in decode(live.recv(), TokenBatch).events]
        deadline = time.monotonic() + 60
        while len(received) < STEPS and time.monotonic() < deadline:
            if live.poll(100):
                received += [e.output_index for e in decode(live.recv(), TokenBatch).events]
        assert set(stalled) == {stuck_addr}
        assert received == list(range(STEPS))
        sink.forget(stuck_addr)
        assert stuck_addr not in sink.sockets
    finally:
        sink.close()
        stuck.close()
        live.close()
        ctx.term()


@pytest.mark.timeout(60)
def test_dial_connects_before_the_first_event():
    """A decode worker dials a job's gateway when it grants the KV: by the time the first event goes, the
    handshake is done, so an ack on a connection already up cannot overtake it (shared/wire/rerun.py)."""
    ctx = zmq.Context()
    gateway, addr = pull(ctx)
    sink = EventSink(ctx, curve=CURVE)
    try:
        sink.dial(addr)
        deadline = time.monotonic() + 30
        while not sink.reached(addr) and time.monotonic() < deadline:
            sink.take_lost()  # reads the connection's monitor events
            time.sleep(0.01)
        assert sink.reached(addr)
        assert not gateway.poll(0)  # dialing sends nothing
        sink.add(addr, TokenEvent(request_id="r", token_ids=[7], output_index=1))
        sink.flush()
        assert gateway.poll(5000)
        assert [e.token_ids for e in decode(gateway.recv(), TokenBatch).events] == [[7]]
        sink.dial(addr)  # already open: the same connection
        assert len(sink.sockets) == 1
    finally:
        sink.close()
        gateway.close()
        ctx.term()
