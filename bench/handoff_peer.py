"""The decode-side process of ``kvrelay bench handoff`` (a real ``HandoffReceiver`` over a KV cache of the
bench's shape, beside a raw ZMQ echo for the baselines), and ``Peer``, the bench's handle on it.

The benchmark's KV shape lives here too: Llama-3-8B's KV (32 layers, 8 KV heads of 128, bf16), blocks of 8."""

import argparse
import os
import subprocess
import sys
import threading
import time

import torch
import zmq

from kvrelay.decode_worker.receiver import HandoffReceiver
from kvrelay.shared.config.handover import module_argv
from kvrelay.shared.config.zmq_secret import ZMQ_SECRET_ENV
from kvrelay.shared.handoff.blocks import DTYPES
from kvrelay.shared.handoff.frames import max_message_bytes
from kvrelay.shared.handoff.standalone import endpoint, serves
from kvrelay.shared.wire import zmq_auth
from kvrelay.shared.wire.zmq_auth import CurveKeys, keys_from_secret

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 8
MODEL = "bench-kv"

def _peer(args: argparse.Namespace) -> None:
    layers, heads, head_dim = (int(x) for x in args.kv_shape.split(","))
    kv = torch.zeros((layers, 2, args.blocks, BLOCK, heads, head_dim), dtype=DTYPES[args.dtype], device=args.device)
    rt = endpoint(kv, "bench-decode", MODEL, scatter_seed=1 if args.scatter else None)
    ctx = zmq.Context(io_threads=1 + args.frame_streams)  # as a decode worker's (shared/worker/runtime.py)
    frame_max = max_message_bytes(kv, args.blocks)
    router, pull, ack = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    addrs = []
    keys = curve()
    zmq_auth.serve(router, keys)
    # as a decode worker's bulk sockets (--kv-frame-streams)
    macd = keys is not None and args.frames == "mac"
    bulk = [ctx.socket(zmq.ROUTER) for _ in range(args.frame_streams)] if macd else []
    for i, sock in enumerate((router, pull, ack, *bulk)):
        sock.setsockopt(zmq.AFFINITY, 1 << max(0, i - 2))  # the bulk sockets a thread each, as a decode worker's
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, frame_max * (LAYERS if sock is pull else 1))  # pull: raw, 1 message
        if args.transport == "tcp":
            addrs.append(f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}")
        else:
            addrs.append(f"ipc:///tmp/kvrelay-bench-{args.tag}-{i}")
            sock.bind(addrs[-1])
    receiver = HandoffReceiver(router, serves(MODEL, rt.core), grant_ttl_s=60.0,
                               bulk=list(zip(bulk, addrs[3:], strict=True)) or None)
    stop = threading.Event()

    def raw_echo():  # the baseline: take the bytes, say so, nothing else
        while True:
            if len(pull.recv(copy=False)) == 0:
                stop.set()
                return
            ack.send(b"k")

    threading.Thread(target=raw_echo, daemon=True).start()
    print("READY", *addrs[:3], flush=True)
    while not stop.is_set():
        receiver.poll(50, lambda h: rt.core.kv.free(h.request_id))  # the bench only moves KV
    ctx.destroy(linger=0)


def curve() -> CurveKeys | None:
    """The run's keys (run() puts its secret in the environment, which the peer process inherits)."""
    secret = os.environ.get(ZMQ_SECRET_ENV)
    return keys_from_secret(secret, insecure=secret is None)



# how the frames travel: "mac", on the peer's plain bulk sockets, each MAC'd (a CURVE deployment's default);
# "curve", encrypted on its CURVE socket with CRCs (--encrypt-kv-frames); "insecure", every socket without
# CURVE, CRCs (--insecure-zmq). Without a secret in the environment every mode is "insecure"
FRAME_MODES = ("mac", "curve", "insecure")


class Peer:
    def __init__(self, device: str, transport: str, max_tokens: int, scatter: bool,
                 kv_shape: tuple[int, int, int] = (LAYERS, KV_HEADS, HEAD_DIM), dtype: str = "bfloat16",
                 frames: str = "mac", streams: int = 1):
        """``streams``: the bulk sockets MAC'd frames come on (--kv-frame-streams)."""
        self.streams = streams
        blocks = 2 * (max_tokens // BLOCK) + 8
        argv = [*module_argv("kvrelay.bench.handoff_peer"), "--device", device, "--transport", transport,
                "--blocks", str(blocks), "--tag", f"{id(self)}-{time.monotonic_ns()}",
                "--kv-shape", ",".join(map(str, kv_shape)), "--dtype", dtype, "--frames", frames,
                "--frame-streams", str(streams)]
        env = {k: v for k, v in os.environ.items() if k != ZMQ_SECRET_ENV or frames != "insecure"}
        self.keys = curve() if frames != "insecure" else None  # this side's, as the peer's
        self.proc = subprocess.Popen(argv + (["--scatter"] if scatter else []), stdout=subprocess.PIPE, text=True,
                                     env=env)
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "READY":
            raise RuntimeError("handoff bench peer failed to start")
        self.router, self.raw, self.ack = line[1:]
        self.ctx = zmq.Context()
        self.push, self.pull = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.push.connect(self.raw)
        self.pull.connect(self.ack)

    def cpu_s(self) -> float:
        """CPU seconds the peer process used so far, every thread (Linux's /proc; NaN elsewhere)."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def close(self) -> None:
        self.push.send(b"")
        self.proc.wait(30)
        self.ctx.destroy(linger=0)



def _peer_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="the decode-side peer of `kvrelay bench handoff`")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--transport", default="tcp", choices=["tcp", "ipc"])
    parser.add_argument("--blocks", type=int, required=True)
    parser.add_argument("--tag", default="0")
    parser.add_argument("--scatter", action="store_true")
    parser.add_argument("--kv-shape", default=f"{LAYERS},{KV_HEADS},{HEAD_DIM}", help="layers,KV heads,head dim")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--frames", default="mac", choices=FRAME_MODES)
    parser.add_argument("--frame-streams", type=int, default=1)
    return parser.parse_args(argv)



if __name__ == "__main__":  # started by Peer
    _peer(_peer_args(sys.argv[1:]))
