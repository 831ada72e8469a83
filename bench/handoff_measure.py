"""Timed transfers of ``kvrelay bench handoff`` between this process, playing the prefill worker (a real
``HandoffManager``), and the decode-side peer: whole handoffs through our code, and raw ZMQ of the same bytes."""

import statistics
import time

import torch
import zmq

from kvrelay.bench.handoff_peer import BLOCK, HEAD_DIM, KV_HEADS, LAYERS, MODEL, Peer, curve
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


def protocol(device: str, peer: Peer, tokens: list[int], repeats: int, ipc: bool,
              scatter: bool = True) -> tuple[dict[int, float], dict[int, list[float]]]:
    """Median seconds of one whole handoff per size, and the median of each phase (ms): request ->
    grant, grant -> KV out (copied, or the last frame queued), -> ack."""
    kv = torch.randn((LAYERS, 2, 2 * (max(tokens) // BLOCK) + 8, BLOCK, KV_HEADS, HEAD_DIM),
                     dtype=torch.bfloat16, device=device)
    rt = endpoint(kv, "bench-prefill", MODEL, scatter_seed=2 if scatter else None)
    ctx = zmq.Context()
    # without CUDA IPC among its transports the sender offers nothing to map: the host-staged frames
    manager = HandoffManager(ctx, rt, timeout_s=60.0, workers=lambda: [decode_info(peer.router, MODEL)],
                             transports=None if ipc else [Frames()], curve=curve())
    out, phases, n = {}, {}, 0
    try:
        for num_tokens in tokens:
            seen = []

            def one(num_tokens=num_tokens, seen=seen):
                nonlocal n
                n += 1
                t, _ = hand_off(manager, rt, f"r{n}", num_tokens, MODEL)
                if t.state is not State.DONE or t.transport != ("ipc" if ipc else "layers"):
                    raise RuntimeError(f"handoff ended {t.state.value} over {t.transport!r}: {t.reason}")
                seen.append([t.granted - t.started, t.sent - t.granted, t.ended - t.sent])

            out[num_tokens] = median_s(one, repeats)
            phases[num_tokens] = [statistics.median(p) * 1e3 for p in zip(*seen[-repeats:], strict=True)]
    finally:
        manager.close()
        ctx.destroy(linger=0)
    return out, phases


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
