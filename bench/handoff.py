"""``kvrelay bench handoff``: KV handoff bandwidth between two real processes, through the real code.

This process plays the prefill worker (a real ``HandoffManager``), a child process the decode worker (a
real ``HandoffReceiver``); one transfer is timed from the HandoffRequest to the ack, so the grant and
ack round trips count. Shape: Llama-3-8B's KV (32 layers, 8 KV heads of 128, bf16, 128 KiB a token;
2,048 tokens = 256 MiB), blocks of 8 tokens scattered on both sides as in a long-running worker.

- CPU: layer frames over loopback TCP and ipc://, against raw ZMQ PUSH/PULL of the same bytes
  (one frame, then a one-byte ack back: no protocol, no staging, no CRC).
- CUDA: CUDA IPC (the decode process's cache mapped in this one, device copy, ZMQ for control only)
  against a device-to-device ``copy_`` of the same bytes inside one process, and for scattered blocks
  against the same handoff with the copy done as a row gather + scatter (the old path, the kernel's
  torch reference); the block copy alone in one process (kernel, row gather + scatter, strided slices
  per contiguous run, d2d ``copy_``); and the host-staged layer frames from and to GPU caches,
  against raw ZMQ of the same bytes from host memory.
Every number is the median of ``--repeats`` timed transfers after one warm-up; GB/s = 1e9 bytes/s.
Our sockets authenticate and encrypt (CURVE) as a deployment's do, with a secret generated per run, and the
frames go as a deployment's do by default: dealt across the decode side's plain bulk sockets, each MAC'd. The CPU
section also runs them as ``--frame-modes`` lists (``curve``: encrypted on the CURVE socket, ``--encrypt-kv-frames``;
``insecure``: no CURVE anywhere, ``--insecure-zmq``), the MAC'd ones over each of ``--frame-streams`` bulk socket
counts (``--kv-frame-streams``), and prints them side by side with ratios.
``--insecure-zmq`` measures every section without CURVE. The raw ZMQ baselines are plain sockets either way.
"""

import argparse
import os
import sys

import torch

from kvrelay.bench.handoff_copy import copy_paths, device_copy, use_copy
from kvrelay.bench.handoff_measure import Handoffs, interleaved, kv_bytes, protocol, raw_zmq
from kvrelay.bench.handoff_overlap import overlap
from kvrelay.bench.handoff_peer import BLOCK, FRAME_MODES, HEAD_DIM, KV_HEADS, LAYERS, Peer
from kvrelay.shared.config.worker import WorkerConfig
from kvrelay.shared.config.zmq_secret import ZMQ_SECRET_ENV, generate
from kvrelay.shared.handoff.frames import MESSAGE_TARGET
from kvrelay.shared.wire.handoff import MAX_FRAME_STREAMS

DEFAULT_STREAMS = WorkerConfig.__pydantic_fields__["kv_frame_streams"].default  # a decode worker's


def _phase_table(title: str, move: str, phases: dict[int, list[float]]) -> None:
    print(f"\n{title}: where the time goes (median ms)\n| KV size | request -> grant | {move} | -> ack |\n"
          "| --- | --- | --- | --- |")
    for num_tokens, (grant, out, ack) in phases.items():
        print(f"| {kv_bytes(num_tokens) / 2**20:.0f} MiB | {grant:.3f} | {out:.3f} | {ack:.3f} |", flush=True)


def _cpu_table(title: str, by_mode: dict[str, tuple]) -> None:
    """Each mode's GB/s beside the CPU seconds each side spent per GB moved: on a shared, loaded box the GB/s
    swing with the load, the CPU seconds much less, so a change that removes work shows there on any box."""
    print(f"\n{title}: CPU seconds per GB moved (this process = prefill side, every thread; the peer = decode side)\n"
          "| KV size | frames | GB/s | prefill CPU s/GB | decode CPU s/GB |\n| --- | --- | --- | --- | --- |")
    for mode, (secs, _, cpu) in by_mode.items():
        for num_tokens, s in secs.items():
            send, recv = cpu[num_tokens]
            print(f"| {kv_bytes(num_tokens) / 2**20:.0f} MiB | {_label(mode)} | {kv_bytes(num_tokens) / s / 1e9:,.2f} | "
                  f"{send:.3f} | {recv:.3f} |", flush=True)


def _table(title: str, ours: str, mine: dict[int, float], *baselines: tuple[str, dict[int, float]]) -> None:
    head = " | ".join(f"{name} GB/s | ratio" for name, _ in baselines)
    print(f"\n{title}\n| KV size | tokens | {ours} GB/s | {head} |\n|" + " --- |" * (3 + 2 * len(baselines)))
    for num_tokens, secs in mine.items():
        nbytes = kv_bytes(num_tokens)
        a = nbytes / secs / 1e9
        cells = [f"{nbytes / b[num_tokens] / 1e9:,.2f} | {a * b[num_tokens] / nbytes * 1e9:.2f}" for _, b in baselines]
        print(f"| {nbytes / 2**20:.0f} MiB | {num_tokens} | {a:,.2f} | " + " | ".join(cells) + " |", flush=True)


FRAME_LABELS = {"mac": "MAC'd frames", "curve": "CURVE-encrypted frames", "insecure": "--insecure-zmq frames"}


def _label(variant: tuple[str, int]) -> str:
    mode, streams = variant
    if mode != "mac":
        return FRAME_LABELS[mode]
    return f"{FRAME_LABELS[mode]}, {streams} plain bulk socket{'s' if streams > 1 else ''}"


def _cpu_frames(transport: str, tokens: list[int], repeats: int, modes: list[str], streams: list[int]) -> None:
    """The first of ``modes`` (MAC'd frames: over each of ``streams`` bulk sockets) against raw ZMQ; each one's
    phases; the first against the others (their transfers take turns: ``interleaved``)."""
    peers = {}
    try:
        for mode in modes:
            for n in streams if mode == "mac" else [1]:
                peers[mode, n] = Peer("cpu", transport, max(tokens), scatter=True, frames=mode, streams=n)
        by_mode = interleaved({m: Handoffs("cpu", peer, max(tokens), ipc=False) for m, peer in peers.items()},
                              tokens, repeats)
        first, *others = peers
        raw, raw4 = raw_zmq(peers[first], tokens, repeats), raw_zmq(peers[first], tokens, repeats, MESSAGE_TARGET)
    finally:
        for peer in peers.values():
            peer.close()
    title = f"CPU caches, layer frames over {transport}"
    _table(f"{title} ({_label(first)})", "kvrelay frames", by_mode[first][0], ("raw ZMQ, 1 message", raw),
           ("raw ZMQ, 4 MiB messages", raw4))
    for variant in peers:
        _phase_table(f"{title} ({_label(variant)})", "grant -> last frame queued", by_mode[variant][1])
    _cpu_table(title, by_mode)
    if others:
        _table(f"{title}: how the frames are protected and spread (ratio: first column over each)", _label(first),
               by_mode[first][0], *((_label(v), by_mode[v][0]) for v in others))


def run(args: argparse.Namespace) -> int:
    tokens = [int(t) for t in args.tokens.split(",")]
    streams = [int(n) for n in args.frame_streams.split(",") if n.strip().isdigit()]
    if len(streams) != len(args.frame_streams.split(",")) or not all(1 <= n <= MAX_FRAME_STREAMS for n in streams):
        raise SystemExit(f"--frame-streams: a list of socket counts, 1..{MAX_FRAME_STREAMS}")
    os.environ.pop(ZMQ_SECRET_ENV, None)
    if not args.insecure_zmq:
        os.environ[ZMQ_SECRET_ENV] = generate()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"KV handoff, Llama-3-8B KV shape ({LAYERS} layers x {KV_HEADS} KV heads x {HEAD_DIM}, bf16, "
          f"{BLOCK}-token blocks), median of {args.repeats}")
    if "cpu" in args.sections.split(","):
        modes = ["insecure"] if args.insecure_zmq else args.frame_modes.split(",")
        if not modes or not set(modes) <= set(FRAME_MODES):
            raise SystemExit(f"--frame-modes: a list of {', '.join(FRAME_MODES)}")
        for transport in args.transports.split(","):
            _cpu_frames(transport, tokens, args.repeats, modes, streams)
    if "overlap" in args.sections.split(","):
        model = args.overlap_model or ("dummy:llama-3-8b" if device == "cuda" else "dummy:smollm2-135m")
        overlap(device, model, [int(t) for t in args.overlap_tokens.split(",")], args.repeats)
    if device == "cuda" and "cuda" in args.sections.split(","):
        copy = device_copy(tokens, args.repeats)
        paths = copy_paths(tokens, args.repeats)
        _table("GPU block copy alone in one process, scattered blocks, layer-major -> block-major pool view",
               "copy kernel", paths["kernel"], ("row gather + scatter (old)", paths["rows"]), ("d2d copy_", copy))
        _table("GPU block copy alone in one process, one contiguous run of blocks", "copy kernel",
               paths["kernel, 1 run"], ("strided slices (the handoff's path for <= 8 runs)", paths["slices, 1 run"]),
               ("d2d copy_", copy))
        for scatter in (True, False):
            peer = Peer("cuda", "tcp", max(tokens), scatter=scatter, streams=streams[0])
            try:
                ipc, ipc_phases = protocol("cuda", peer, tokens, args.repeats, ipc=True, scatter=scatter)
                old, old_phases = {}, {}
                if scatter:  # the same handoff with the copy as the row gather + scatter it was
                    use_copy("rows")
                    old, old_phases = protocol("cuda", peer, tokens, args.repeats, ipc=True)
                    use_copy("kernel")
                staged, staged_phases = protocol("cuda", peer, tokens, args.repeats, ipc=False) if scatter else ({}, {})
                raw = raw_zmq(peer, tokens, args.repeats) if scatter else {}
                raw4 = raw_zmq(peer, tokens, args.repeats, MESSAGE_TARGET) if scatter else {}
            finally:
                peer.close()
            title = f"GPU caches, CUDA IPC between processes ({'scattered' if scatter else 'contiguous'} blocks)"
            rows = [("row gather + scatter (old)", old)] if old else []
            _table(title + "; request -> ack, control over tcp", "kvrelay IPC", ipc, *rows, ("in-process d2d copy_", copy))
            copy_only = {k: ph[1] / 1e3 for k, ph in ipc_phases.items()}
            rows = [("row gather + scatter (old)", {k: ph[1] / 1e3 for k, ph in old_phases.items()})] if old else []
            _table(title + ", grant -> copied + header out only", "IPC copy", copy_only, *rows,
                   ("in-process d2d copy_", copy))
            _phase_table(title, "grant -> copied + header out", ipc_phases)
            if scatter:
                how = _label(("insecure", 1) if args.insecure_zmq else ("mac", streams[0]))
                _table(f"GPU caches, host-staged layer frames over tcp ({how})", "kvrelay frames", staged,
                       ("raw ZMQ host bytes, 1 message", raw), ("raw ZMQ, 4 MiB messages", raw4))
                _phase_table("GPU caches, host-staged layer frames", "grant -> last frame queued", staged_phases)
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", default="8,64,256,1024,2048", help="prompt lengths (128 KiB of KV a token)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--transports", default="tcp,ipc", help="ZMQ transports for the CPU section")
    p.add_argument("--sections", default="cpu,cuda,overlap")
    p.add_argument("--overlap-model", default=None,
                   help="dummy model of the overlap section (default: CUDA Llama-3-8B, CPU SmolLM2-135M shapes)")
    p.add_argument("--overlap-tokens", default="256,1024,2048", help="prompt lengths of the overlap section")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--insecure-zmq", action="store_true", help="our sockets without CURVE (default: with, as served)")
    p.add_argument("--frame-modes", default=",".join(FRAME_MODES),
                   help="how the CPU section's frames go, the first against raw ZMQ and against each other: mac (plain "
                   "bulk sockets, a MAC a frame: the default served), curve (encrypted: --encrypt-kv-frames), "
                   "insecure (--insecure-zmq)")
    p.add_argument("--frame-streams", default=str(DEFAULT_STREAMS),
                   help="bulk sockets the CPU section's MAC'd frames are dealt across, a list to compare side by side "
                   "(a decode worker's --kv-frame-streams); the CUDA section's frames take the first")


if __name__ == "__main__":  # `kvrelay bench handoff`
    bench = argparse.ArgumentParser(prog="python -m kvrelay.bench.handoff", description=__doc__.split("\n")[0])
    add_args(bench)
    sys.exit(run(bench.parse_args()))
