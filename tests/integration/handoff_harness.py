"""The two halves of the KV handoff without an engine, over real ZMQ sockets, for the handoff tests:
a decode side (a real HandoffReceiver on its own thread) and a prefill side (real HandoffManagers in
the test's thread)."""

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

import torch
import zmq

from kvrelay.decode_worker.receiver import HandoffReceiver
from kvrelay.prefill_worker.handoff import HandoffManager, Transfer
from kvrelay.shared.handoff.frames import max_message_bytes
from kvrelay.shared.handoff.standalone import decode_info, endpoint, hand_off, serves, synthetic_job
from kvrelay.shared.wire import zmq_auth
from kvrelay.shared.wire.handoff import HandoffGrant, KVHeader
from tests.zmq_secret import CURVE

MODEL = "tiny"
SHAPE = (8, 2, 96, 16, 4, 64)  # fp32: 256 KiB a block, so 10 MiB transfers go through the thread pool
BLOCK = SHAPE[3]


class DecodeSide:
    """A decode worker's handoff half on its own thread; admitted requests keep their blocks."""

    def __init__(self, kv: torch.Tensor, ttl_s: float = 5.0, transports=None, asker_alive=None, bulk: int = 0,
                 prefix_caching: bool = False):
        """``bulk``: with that many plain bulk sockets (True: one), as a decode worker under CURVE has: frames
        come there MAC'd. ``prefix_caching``: grants may reuse blocks cached here (a test caches them through
        ``rt.core.kv``)."""
        self.ctx = zmq.Context(io_threads=1 + int(bulk))
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes(kv, kv.shape[2]))  # as the decode worker
        zmq_auth.serve(self.sock, CURVE)
        self.addr = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.bulk = []  # (socket, address) each
        for _ in range(int(bulk)):
            sock = self.ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes(kv, kv.shape[2]))
            self.bulk.append((sock, f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"))
        self.bulk_addr = self.bulk[0][1] if self.bulk else ""
        self.rt = endpoint(kv, "d1", MODEL, prefix_caching=prefix_caching)
        self.receiver = HandoffReceiver(self.sock, serves(MODEL, self.rt.core), ttl_s, transports=transports,
                                        asker_alive=asker_alive, bulk=self.bulk or None)
        self.admitted: dict[str, KVHeader] = {}
        self.paused, self.resting = threading.Event(), threading.Event()  # see pause()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.paused.is_set():
                self.resting.set()
                time.sleep(0.01)
                continue
            self.receiver.poll(20, lambda h: self.admitted.setdefault(h.request_id, h))

    def pause(self) -> None:
        """Read nothing from now until ``paused`` is cleared, as a decode worker in a long step."""
        self.resting.clear()
        self.paused.set()
        assert self.resting.wait(10), "the decode side did not pause"

    def blocks(self, rid: str) -> list[int]:
        return self.rt.core.kv.block_ids(rid)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.ctx.destroy(linger=0)


def prefill_side() -> Iterator:
    """For a fixture: (the prefill endpoint, ``make(addr, timeout_s, transports, also)`` of managers sending
    to the decode worker at ``addr``, or when it does not answer, to those at ``also``, in order); closes them after."""
    kv = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    rt = endpoint(kv, "p1", MODEL, scatter_seed=3)
    ctx = zmq.Context()
    managers = []

    def make(addr: str, timeout_s: float = 5.0, transports=None, also: tuple[str, ...] = ()) -> HandoffManager:
        workers = [decode_info(a, MODEL, f"d{i + 1}") for i, a in enumerate((addr, *also))]
        managers.append(HandoffManager(ctx, rt, timeout_s, workers=lambda: workers, transports=transports,
                                       curve=CURVE))
        return managers[-1]

    yield rt, make
    for m in managers:
        m.close()
    ctx.destroy(linger=0)


def decode_sides() -> Iterator:
    """For a fixture: ``make(dtype, ttl_s=, transports=, asker_alive=)`` of DecodeSides; closes them after."""
    sides = []

    def make(dtype=torch.float32, **kw) -> DecodeSide:
        sides.append(DecodeSide(torch.zeros(SHAPE, dtype=dtype), **kw))
        return sides[-1]

    yield make
    for side in sides:
        side.close()


def hand_off_tiny(manager: HandoffManager, rt, rid: str, num_tokens: int) -> tuple[Transfer, list[int]]:
    return hand_off(manager, rt, rid, num_tokens, MODEL, timeout_s=30)


def read_as_older_asker(manager: HandoffManager, sent: Callable[[HandoffGrant], bool], **dropped) -> list[str]:
    """``manager`` reads its grants as a prefill worker that does not know some ignorable fields: where ``sent(grant)``,
    those fields take their ``dropped`` values before it sees them. The request ids of the grants so read, as they
    come."""
    on_answer, stripped = manager._on_answer, []

    def as_older_asker(peer, msg):
        if isinstance(msg, HandoffGrant) and sent(msg):
            stripped.append(msg.request_id)
            msg = dataclasses.replace(msg, **dropped)
        on_answer(peer, msg)

    manager._on_answer = as_older_asker
    return stripped


def peer_router() -> tuple[zmq.Socket, str]:
    """A decode worker's socket driven by hand (a test decides what it answers, and when), and its address."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 15_000)
    zmq_auth.serve(sock, CURVE)
    return sock, f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"


def wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.01)


def poll_until(manager: HandoffManager, cond, what: str) -> list:
    ended: list = []
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        ended += manager.poll(20)
    return ended


def early(manager: HandoffManager, rid: str, num_tokens: int) -> Transfer:
    return manager.start_early(synthetic_job(rid, num_tokens, MODEL), rid.encode())
