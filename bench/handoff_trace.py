"""Where one handoff's time goes, across both processes: ``python -m kvrelay.bench.handoff_trace``.

The prefill side (this process, a real ``HandoffManager``) and the decode side (``handoff_peer``'s process, a
real ``HandoffReceiver``) each stamp ``time.perf_counter()`` at the points a transfer passes: on Linux both read
CLOCK_MONOTONIC, so one process's stamps line up with the other's. The stamps come from wrappers this module puts
around the handoff's own methods (ask out, message in, reply out, the sender opened, the copy waited for, header
out, ack in), nothing in the handoff itself knows of them. Prints, per KV size, the median offset of every stamp
from the transfer's start and the median gap from the stamp before: the control round trips, each side's Python
between receiving and replying, and on CUDA the device copy, each on its own line.

On CUDA the transfer goes through CUDA IPC (the peer's cache mapped here), elsewhere as layer frames.
"""

import argparse
import atexit
import json
import os
import statistics
import sys
import tempfile
import time

STAMPS: list[tuple[float, str]] = []
_OUT_ENV = "KVRELAY_TRACE_STAMPS"  # where the peer writes its stamps at exit


def stamp(what: str) -> None:
    STAMPS.append((time.perf_counter(), what))


def _wrap(cls, name: str, before: str = "", after: str = "") -> None:
    fn = getattr(cls, name)

    def wrapped(*args, **kwargs):
        if before:
            stamp(before)
        out = fn(*args, **kwargs)
        if after:
            stamp(after(args, kwargs) if callable(after) else after)
        return out

    setattr(cls, name, wrapped)


def _trace_decode_side() -> None:
    from kvrelay.shared.handoff.inbox_socket import InboxSocket
    from kvrelay.shared.handoff.receiver import KVInbox

    messages = InboxSocket.messages

    def stamped(self, timeout_ms, spin_s=0.0):
        for m in messages(self, timeout_ms, spin_s):
            stamp("decode: message in")
            yield m

    InboxSocket.messages = stamped
    _wrap(KVInbox, "_on_message", after="decode: message handled")
    _wrap(InboxSocket, "reply", after=lambda args, kwargs: f"decode: {type(args[2]).__name__} out")


def _trace_prefill_side() -> None:
    from kvrelay.shared.handoff.blocks import BlockCopy
    from kvrelay.shared.handoff.direct import DeviceCopy, DirectWrite
    from kvrelay.shared.handoff.frames import Frames
    from kvrelay.shared.handoff.peer_sockets import PeerSockets
    from kvrelay.shared.handoff.sender_io import SenderIO

    _wrap(PeerSockets, "send", after=lambda args, kwargs: "prefill: frame out"
          if kwargs.get("bulk", args[3] if len(args) > 3 else False) else "prefill: message out")
    _wrap(SenderIO, "_on_reply", before="prefill: reply in")
    for transport in (DirectWrite, Frames):
        _wrap(transport, "sender", before="prefill: opening the sender", after="prefill: sender opened")
    _wrap(BlockCopy, "__init__", after="prefill: copy planned (block ids sent to the device)")
    _wrap(BlockCopy, "__call__", after="prefill: copy launched")
    _wrap(DeviceCopy, "wait", before="prefill: waiting for the copy", after="prefill: copy done")


def _write_stamps(path: str) -> None:
    with open(path, "w") as f:
        json.dump(STAMPS, f)


def _peer_main(argv: list[str]) -> None:
    from kvrelay.bench import handoff_peer

    _trace_decode_side()
    atexit.register(_write_stamps, os.environ[_OUT_ENV])
    handoff_peer._peer(handoff_peer._peer_args(argv))


def _transfers(stamps: list[tuple[float, str]]) -> list[list[tuple[float, str]]]:
    """The merged stamps cut at each "start" (transfers run one at a time)."""
    out: list[list[tuple[float, str]]] = []
    for t, what in sorted(stamps):
        if what == "start":
            out.append([])
        if out:
            out[-1].append((t, what))
    return out


def report(stamps: list[tuple[float, str]], label: str) -> None:
    """Each stamp's median offset from its transfer's start, the n-th of a kind told apart ("#n": frames and their
    arrivals interleave differently from one transfer to the next), in the order of those medians; stamps seen in
    fewer than half the transfers are left out."""
    runs = _transfers(stamps)
    offsets: dict[str, list[float]] = {}
    for run in runs:
        seen: dict[str, int] = {}
        for t, what in run:
            seen[what] = seen.get(what, 0) + 1
            key = what if seen[what] == 1 else f"{what} #{seen[what]}"
            offsets.setdefault(key, []).append((t - run[0][0]) * 1e3)
    rows = sorted((statistics.median(v), key, len(v)) for key, v in offsets.items() if len(v) * 2 >= len(runs))
    print(f"\n{label}: {len(runs)} transfers; median ms\n| stamp | from start | from the row before | transfers |\n"
          "| --- | --- | --- | --- |")
    before = 0.0
    for at, key, n in rows:
        print(f"| {key} | {at:.3f} | {at - before:.3f} | {n} |", flush=True)
        before = at


def run(args: argparse.Namespace) -> int:
    import torch

    from kvrelay.bench import handoff_peer
    from kvrelay.bench.handoff_measure import Handoffs, kv_bytes
    from kvrelay.shared.config.zmq_secret import ZMQ_SECRET_ENV, generate
    from kvrelay.shared.handoff.standalone import hand_off

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    os.environ[ZMQ_SECRET_ENV] = generate()
    _trace_prefill_side()
    for num_tokens in [int(t) for t in args.tokens.split(",")]:
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        os.environ[_OUT_ENV] = path
        argv = handoff_peer.module_argv
        handoff_peer.module_argv = lambda module: [sys.executable, "-m", "kvrelay.bench.handoff_trace", "--peer"]
        try:
            peer = handoff_peer.Peer(device, "tcp", num_tokens, scatter=True)
        finally:
            handoff_peer.module_argv = argv
        h = Handoffs(device, peer, num_tokens, ipc=device == "cuda")
        for i in range(2 + args.repeats):
            if i == 2:
                STAMPS.clear()  # the two warm-ups map the peer's cache and open the connections
            stamp("start")
            t, _ = hand_off(h.manager, h.rt, f"t{num_tokens}-{i}", num_tokens, handoff_peer.MODEL)
            stamp("end")
            if t.reason:
                raise RuntimeError(f"handoff failed: {t.reason}")
        h.close()
        peer.close()
        with open(path) as f:
            theirs = [(t, w) for t, w in json.load(f) if t >= STAMPS[0][0]]
        os.unlink(path)
        report(STAMPS + theirs, f"{kv_bytes(num_tokens) / 2**20:.0f} MiB ({num_tokens} tokens), "
               f"{'CUDA IPC' if device == 'cuda' else 'layer frames'}")
        STAMPS.clear()
    return 0


def main() -> int:
    if sys.argv[1:2] == ["--peer"]:
        _peer_main(sys.argv[2:])
        return 0
    p = argparse.ArgumentParser(prog="python -m kvrelay.bench.handoff_trace", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="8,2048", help="prompt lengths (128 KiB of KV a token)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    return run(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
