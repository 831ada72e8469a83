"""Timed transfers of ``kvrelay bench handoff`` between this process, playing the prefill worker (a real
``HandoffManager``), and the decode-side peer: whole handoffs through our code, and raw ZMQ of the same bytes."""

import statistics
import time

import torch
import zmq

from kvrelay.bench.handoff_peer import BLOCK, HEAD_DIM, KV_HEADS, LAYERS, MODEL, Peer
from kvrelay.prefill_worker.handoff import HandoffManager, State
from kvrelay.shared.handoff.frames import Frames
from kvrelay.shared.handoff.standalone import decode_info, endpoint, hand_off


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up: connections, first use of each torch kernel, pinned-memory pools, IPC mapping
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Handoffs:
    """Whole handoffs from this process (a real ``HandoffManager`` over its own KV cache) to ``peer``."""

    def __init__(self, device: str, peer: Peer, max_tokens: int, ipc: bool, scatter: bool = True):
        kv = torch.randn((LAYERS, 2, 2 * (max_tokens // BLOCK) + 8, BLOCK, KV_HEADS, HEAD_DIM),
                         dtype=torch.bfloat16, device=device)
        self.rt = endpoint(kv, "bench-prefill", MODEL, scatter_seed=2 if scatter else None)
        self.ctx = zmq.Context(io_threads=1 + peer.streams)  # one for each bulk connection, as a prefill worker has
        self.ipc, self.n, self.peer = ipc, 0, peer
        # without CUDA IPC among its transports the sender offers nothing to map: the host-staged frames
        self.manager = HandoffManager(self.ctx, self.rt, timeout_s=60.0, workers=lambda: [decode_info(peer.router, MODEL)],
                                      transports=None if ipc else [Frames()], curve=peer.keys)

    def one(self, num_tokens: int) -> tuple[float, list[float], tuple[float, float]]:
        """Seconds of one whole handoff, its phases (s): request -> grant, grant -> KV out, -> ack, and the CPU
        seconds it took (this process's, every thread; the peer process's)."""
        self.n += 1
        cpu0, peer0 = time.process_time(), self.peer.cpu_s()
        t0 = time.perf_counter()
        t, _ = hand_off(self.manager, self.rt, f"r{self.n}", num_tokens, MODEL)
        secs = time.perf_counter() - t0
        cpu = (time.process_time() - cpu0, self.peer.cpu_s() - peer0)
        if t.state is not State.DONE or t.transport != ("ipc" if self.ipc else "layers"):
            raise RuntimeError(f"handoff ended {t.state.value} over {t.transport!r}: {t.reason}")
        return secs, [t.granted - t.started, t.sent - t.granted, t.ended - t.sent], cpu

    def close(self) -> None:
        self.manager.close()
        self.ctx.destroy(linger=0)


def protocol(device: str, peer: Peer, tokens: list[int], repeats: int, ipc: bool,
              scatter: bool = True) -> tuple[dict[int, float], dict[int, list[float]]]:
    """Median seconds of one whole handoff per size, and the median of each phase (ms): request ->
    grant, grant -> KV out (copied, or the last frame queued), -> ack."""
    return interleaved({"": Handoffs(device, peer, max(tokens), ipc, scatter)}, tokens, repeats)[""][:2]


def interleaved(handoffs: dict[str, Handoffs], tokens: list[int], repeats: int
                ) -> dict[str, tuple[dict[int, float], dict[int, list[float]], dict[int, tuple[float, float]]]]:
    """``protocol`` for each of ``handoffs``, taking turns transfer by transfer, so a box whose load changes
    during the run weighs on each alike, with the CPU seconds per GB (1e9 bytes) moved of each side (this
    process's, the peer's), summed over the timed transfers: CPU time, unlike wall time, hardly moves with
    what else runs on the box. Closes them."""
    out = {name: ({}, {}, {}) for name in handoffs}
    try:
        for num_tokens in tokens:
            for h in handoffs.values():  # warm-up: connections, first use of each kernel, pinned pools, IPC maps
                h.one(num_tokens)
                h.one(num_tokens)
            runs: dict[str, list] = {name: [] for name in handoffs}
            for _ in range(repeats):
                for name, h in handoffs.items():
                    runs[name].append(h.one(num_tokens))
            for name, seen in runs.items():
                out[name][0][num_tokens] = statistics.median(secs for secs, _, _ in seen)
                out[name][1][num_tokens] = [statistics.median(p) * 1e3 for p in zip(*(ph for _, ph, _ in seen), strict=True)]
                gb = kv_bytes(num_tokens) * len(seen) / 1e9
                out[name][2][num_tokens] = tuple(sum(side) / gb for side in zip(*(c for _, _, c in seen), strict=True))
    finally:
        for h in handoffs.values():
            h.close()
    return out


def raw_zmq(peer: Peer, tokens: list[int], repeats: int, chunk: int | None = None) -> dict[int, float]:
    """Raw PUSH/PULL of the same bytes: one message, or ``chunk``-byte messages (each acked)."""
    out = {}
    for num_tokens in tokens:
        payload = memoryview(torch.randint(0, 255, (kv_bytes(num_tokens),), dtype=torch.uint8).numpy())
        parts = [payload[i:i + chunk] for i in range(0, len(payload), chunk)] if chunk else [payload]

        def one(parts=parts):
            for part in parts:
                peer.push.send(part, copy=False)
            for _ in parts:
                peer.pull.recv()

        out[num_tokens] = median_s(one, repeats)
    return out


def kv_bytes(num_tokens: int) -> int:
    return LAYERS * 2 * num_tokens * KV_HEADS * HEAD_DIM * 2
