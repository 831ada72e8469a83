"""Rank 0's per-step broadcast to the other ranks: one ZMQ PUSH socket per rank over ipc:// in the group's
private folder (mode 0700, so only this user's processes can connect), carrying typed msgpack messages
(shared/wire/rank_step.py) and, after a ``RankStep``, the step's packed int32 inputs as one raw frame.
Never pickle. Collectives (all-reduce, all-gather) go over torch.distributed; only the step's inputs
travel here, so a rank waits on this socket, not on a collective, while the engine is idle.
"""

import time
from collections.abc import Callable
from pathlib import Path

import zmq

from kvrelay.shared.wire import codec
from kvrelay.shared.wire.rank_step import (
    RankAlloc,
    RankKVDrop,
    RankKVExpect,
    RankKVExport,
    RankKVImport,
    RankKVSend,
    RankMessage,
    RankProfile,
    RankStep,
    RankStop,
    RankSwap,
)

_KINDS = (RankAlloc, RankProfile, RankSwap, RankStep, RankKVExport, RankKVImport, RankKVSend, RankKVExpect, RankKVDrop,
          RankStop)
# messages queued for a rank that has not read them yet; ranks run in lockstep, so a full queue means a
# rank stopped reading
SEND_HWM = 64
# how long a send may wait: for a rank whose socket is still connecting (the first message), or whose
# queue is full; past it the rank counts as gone
SEND_TIMEOUT_MS = 10_000
# while a send waits, how often it asks whether the group is down (a dead rank's socket never takes a message)
GONE_POLL_MS = 50


def address(folder: Path, rank: int) -> str:
    return f"ipc://{folder / f'rank{rank}.sock'}"


class StepSender:
    """Rank 0's end: every message goes to every other rank, in order."""

    def __init__(self, folder: Path, world_size: int) -> None:
        self._ctx = zmq.Context()
        self._socks = []
        for rank in range(1, world_size):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(address(folder, rank))
            self._socks.append(sock)

    def send(self, msg: RankMessage, frame: memoryview | None = None, gone: Callable[[], bool] = lambda: False
             ) -> None:
        """Raises ``zmq.Again`` when a rank took no message for SEND_TIMEOUT_MS, or once ``gone()`` says the
        group is down (its watchdog saw a rank die), without waiting that long."""
        parts = [codec.encode(msg)] + ([frame] if frame is not None else [])
        for sock in self._socks:
            deadline = time.monotonic() + SEND_TIMEOUT_MS / 1000
            while True:
                try:
                    sock.send_multipart(parts, flags=zmq.NOBLOCK)  # all parts or none: ZMQ's multipart is atomic
                    break
                except zmq.Again:
                    if gone() or time.monotonic() >= deadline:
                        raise
                    sock.poll(GONE_POLL_MS, zmq.POLLOUT)

    def close(self) -> None:
        for sock in self._socks:
            sock.close(linger=0)
        self._ctx.term()


class StepReceiver:
    """A rank's end."""

    def __init__(self, folder: Path, rank: int) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address(folder, rank))

    def recv(self, timeout_ms: int) -> tuple[RankMessage, bytes | None] | None:
        """The next message and its frame (a ``RankStep``'s inputs), or None after ``timeout_ms``."""
        if not self._sock.poll(timeout_ms):
            return None
        parts = self._sock.recv_multipart()
        msg = codec.decode_any(parts[0], *_KINDS)
        if isinstance(msg, RankStep) != (len(parts) == 2) or len(parts) > 2:
            raise ValueError(f"{type(msg).__name__} arrived with {len(parts) - 1} frames")
        return msg, parts[1] if len(parts) == 2 else None

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
