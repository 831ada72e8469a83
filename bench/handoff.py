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
Our sockets authenticate and encrypt (CURVE) as a deployment's do, with a secret generated per run;
``--insecure-zmq`` measures them without. The raw ZMQ baselines are plain sockets either way.
"""

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import torch
import zmq

from kvrelay import kernels
from kvrelay.decode_worker.receiver import HandoffReceiver
from kvrelay.prefill_worker.handoff import FirstToken, HandoffManager, State
from kvrelay.shared.config.zmq_secret import ZMQ_SECRET_ENV, generate
from kvrelay.shared.handoff.blocks import DTYPE_NAMES, DTYPES, BlockCopy, frame_nbytes
from kvrelay.shared.handoff.frames import MESSAGE_TARGET, Frames, max_message_bytes
from kvrelay.shared.handoff.standalone import decode_info, endpoint, hand_off, serves, synthetic_job
from kvrelay.shared.wire import zmq_auth
from kvrelay.shared.wire.zmq_auth import CurveKeys, keys_from_secret

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 8
MODEL = "bench-kv"


# -- the decode-side child process --------------------------------------------------------------------
def _peer(args: argparse.Namespace) -> None:
    layers, heads, head_dim = (int(x) for x in args.kv_shape.split(","))
    kv = torch.zeros((layers, 2, args.blocks, BLOCK, heads, head_dim), dtype=DTYPES[args.dtype], device=args.device)
    rt = endpoint(kv, "bench-decode", MODEL, scatter_seed=1 if args.scatter else None)
    ctx = zmq.Context()
    frame_max = max_message_bytes(kv, args.blocks)
    router, pull, ack = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    addrs = []
    zmq_auth.serve(router, _curve())
    for i, sock in enumerate((router, pull, ack)):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, frame_max * (LAYERS if sock is pull else 1))  # pull: raw, 1 message
        if args.transport == "tcp":
            addrs.append(f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}")
        else:
            addrs.append(f"ipc:///tmp/kvrelay-bench-{args.tag}-{i}")
            sock.bind(addrs[-1])
    receiver = HandoffReceiver(router, serves(MODEL, rt.core), grant_ttl_s=60.0)
    stop = threading.Event()

    def raw_echo():  # the baseline: take the bytes, say so, nothing else
        while True:
            if len(pull.recv(copy=False)) == 0:
                stop.set()
                return
            ack.send(b"k")

    threading.Thread(target=raw_echo, daemon=True).start()
    print("READY", *addrs, flush=True)
    while not stop.is_set():
        receiver.poll(50, lambda h: rt.core.kv.free(h.request_id))  # the bench only moves KV
    ctx.destroy(linger=0)


def _curve() -> CurveKeys | None:
    """The run's keys (run() puts its secret in the environment, which the peer process inherits)."""
    secret = os.environ.get(ZMQ_SECRET_ENV)
    return keys_from_secret(secret, insecure=secret is None)


# -- measurements -------------------------------------------------------------------------------------
def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up: connections, first use of each torch kernel, pinned-memory pools, IPC mapping
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Peer:
    def __init__(self, device: str, transport: str, max_tokens: int, scatter: bool,
                 kv_shape: tuple[int, int, int] = (LAYERS, KV_HEADS, HEAD_DIM), dtype: str = "bfloat16"):
        blocks = 2 * (max_tokens // BLOCK) + 8
        argv = [sys.executable, "-m", "kvrelay.bench.handoff", "--peer", "--device", device, "--transport", transport,
                "--blocks", str(blocks), "--tag", f"{id(self)}-{time.monotonic_ns()}",
                "--kv-shape", ",".join(map(str, kv_shape)), "--dtype", dtype]
        self.proc = subprocess.Popen(argv + (["--scatter"] if scatter else []), stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "READY":
            raise RuntimeError("handoff bench peer failed to start")
        self.router, self.raw, self.ack = line[1:]
        self.ctx = zmq.Context()
        self.push, self.pull = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.push.connect(self.raw)
        self.pull.connect(self.ack)

    def close(self) -> None:
        self.push.send(b"")
        self.proc.wait(30)
        self.ctx.destroy(linger=0)


def _protocol(device: str, peer: Peer, tokens: list[int], repeats: int, ipc: bool,
              scatter: bool = True) -> tuple[dict[int, float], dict[int, list[float]]]:
    """Median seconds of one whole handoff per size, and the median of each phase (ms): request ->
    grant, grant -> KV out (copied, or the last frame queued), -> ack."""
    kv = torch.randn((LAYERS, 2, 2 * (max(tokens) // BLOCK) + 8, BLOCK, KV_HEADS, HEAD_DIM),
                     dtype=torch.bfloat16, device=device)
    rt = endpoint(kv, "bench-prefill", MODEL, scatter_seed=2 if scatter else None)
    ctx = zmq.Context()
    # without CUDA IPC among its transports the sender offers nothing to map: the host-staged frames
    manager = HandoffManager(ctx, rt, timeout_s=60.0, workers=lambda: [decode_info(peer.router, MODEL)],
                             transports=None if ipc else [Frames()], curve=_curve())
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

            out[num_tokens] = _median_s(one, repeats)
            phases[num_tokens] = [statistics.median(p) * 1e3 for p in zip(*seen[-repeats:], strict=True)]
    finally:
        manager.close()
        ctx.destroy(linger=0)
    return out, phases


def _overlap(device: str, model: str, tokens: list[int], repeats: int) -> dict[int, dict[bool, list[float]]]:
    """A real prefill engine hands each prompt's KV to a decode-side process, plain (asked for after the
    prefill) or streamed (early grant; groups of layers staged and sent as the forward writes them).
    Per prompt length and mode, the medians (ms) of: the prefill step, step end (first token) -> ack,
    step start -> ack. Modes alternate so drift hits both alike."""
    from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from kvrelay.shared.engine import EngineCore
    from kvrelay.shared.wire.sampling_params import SamplingParams

    top = max(tokens) + BLOCK
    engine = EngineCore(EngineConfig(
        model=ModelConfig(model, dtype="auto", max_model_len=top, load_format="dummy"),
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks=2 * (top // BLOCK) + 8),
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=top), device=device), hold_finished_kv=True)
    kv = engine.kv.kv_cache
    peer = Peer(device, "tcp", top, scatter=False, kv_shape=(kv.shape[0], kv.shape[4], kv.shape[5]),
                dtype=DTYPE_NAMES[kv.dtype])
    runtime = SimpleNamespace(core=engine, zmq_addr="", redis=None, config=SimpleNamespace(worker_id="bench-prefill"))
    ctx = zmq.Context()
    manager = HandoffManager(ctx, runtime, timeout_s=60.0, workers=lambda: [decode_info(peer.router, MODEL)],
                             curve=_curve())
    engine.kv.set_layer_saver(manager.stream_for(MODEL))
    gen = torch.Generator().manual_seed(0)
    n = 0

    def one(num_tokens: int, streamed: bool) -> list[float]:
        nonlocal n
        n += 1
        rid = f"o{n}"
        prompt = torch.randint(3, 500, (num_tokens,), generator=gen).tolist()
        engine.add_request(engine.make_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0)))
        job = synthetic_job(rid, num_tokens, MODEL)
        if streamed:  # as the prefill worker does two steps ahead: the grant is there by the forward
            manager.start_early(job, rid.encode())
            while manager.transfers[rid].state is not State.GRANTED:
                manager.poll(timeout_ms=5)
        t0 = time.perf_counter()
        out, = engine.step()
        t1 = time.perf_counter()
        manager.prefilled(job, rid.encode(), FirstToken(out.new_token_ids[0]))
        while True:
            ended = manager.poll(timeout_ms=1)
            if ended:
                break
        t2 = time.perf_counter()
        t, = ended
        if t.state is not State.DONE or t.streamed != streamed:
            raise RuntimeError(f"handoff ended {t.state.value} (streamed {t.streamed}): {t.reason}")
        return [(t1 - t0) * 1e3, (t2 - t1) * 1e3, (t2 - t0) * 1e3], t.transport

    out: dict[int, dict[bool, list[float]]] = {}
    transports = set()
    try:
        for num_tokens in tokens:
            seen: dict[bool, list[list[float]]] = {False: [], True: []}
            for i in range(repeats + 1):  # the first round warms both paths up
                for streamed in (False, True):
                    result, transport = one(num_tokens, streamed)
                    transports.add(transport)
                    if i:
                        seen[streamed].append(result)
            out[num_tokens] = {m: [statistics.median(c) for c in zip(*runs, strict=True)] for m, runs in seen.items()}
    finally:
        manager.close()
        peer.close()
        ctx.destroy(linger=0)
    print(f"\nKV streamed layer by layer during the last chunk vs sent after the prefill: {model} on {device}, "
          f"{kv.shape[0]} layers, {DTYPE_NAMES[kv.dtype]}, {'CUDA IPC' if transports == {'ipc'} else 'layer frames over tcp'}"
          f"; median ms of {repeats}\n| prompt | KV MiB | prefill step, plain | streamed | first token -> ack, plain | "
          "streamed | ratio | step start -> ack, plain | streamed | ratio |\n|" + " --- |" * 10)
    for num_tokens, m in out.items():
        mib = frame_nbytes(kv, -(-num_tokens // BLOCK)) * kv.shape[0] / 2**20
        print(f"| {num_tokens} | {mib:.0f} | {m[False][0]:.1f} | {m[True][0]:.1f} | {m[False][1]:.1f} | {m[True][1]:.1f} | "
              f"{m[True][1] / m[False][1]:.2f} | {m[False][2]:.1f} | {m[True][2]:.1f} | {m[True][2] / m[False][2]:.2f} |",
              flush=True)
    return out


def _phase_table(title: str, move: str, phases: dict[int, list[float]]) -> None:
    print(f"\n{title}: where the time goes (median ms)\n| KV size | request -> grant | {move} | -> ack |\n"
          "| --- | --- | --- | --- |")
    for num_tokens, (grant, out, ack) in phases.items():
        print(f"| {_nbytes(num_tokens) / 2**20:.0f} MiB | {grant:.3f} | {out:.3f} | {ack:.3f} |", flush=True)


def _raw(peer: Peer, tokens: list[int], repeats: int, chunk: int | None = None) -> dict[int, float]:
    """Raw PUSH/PULL of the same bytes: one message, or ``chunk``-byte messages (each acked)."""
    out = {}
    for num_tokens in tokens:
        payload = memoryview(torch.randint(0, 255, (_nbytes(num_tokens),), dtype=torch.uint8).numpy())
        parts = [payload[i:i + chunk] for i in range(0, len(payload), chunk)] if chunk else [payload]

        def one(parts=parts):
            for part in parts:
                peer.push.send(part, copy=False)
            for _ in parts:
                peer.pull.recv()

        out[num_tokens] = _median_s(one, repeats)
    return out


def _device_copy(tokens: list[int], repeats: int) -> dict[int, float]:
    out = {}
    for num_tokens in tokens:
        src = torch.empty(_nbytes(num_tokens), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)

        def one(src=src, dst=dst):
            dst.copy_(src)
            torch.cuda.synchronize()

        out[num_tokens] = _median_s(one, repeats)
    return out


def _use_copy(path: str) -> None:
    """Which block copy the handoff's ``kernels.copy_blocks`` runs on CUDA: the Triton kernel, or its
    torch reference (a row gather + scatter, as the handoff copied before the kernel)."""
    from kvrelay.kernels.triton.copy_blocks import copy_blocks

    kernels.register("copy_blocks", copy_blocks if path == "kernel" else kernels.reference.copy_blocks)


def _copy_paths(tokens: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """The block copy alone, in this process, between two Llama-3-8B-shape caches (the source layer-major,
    the destination a block-major pool view, as a decode worker's is): median seconds per size of the
    copy kernel and of the row gather + scatter over scattered blocks, and over one contiguous run of
    blocks of the kernel and of the strided slices the handoff uses for a few runs."""
    from kvrelay.kernels.triton.copy_blocks import copy_blocks

    blocks = 2 * (max(tokens) // BLOCK) + 8
    shape = (LAYERS, 2, blocks, BLOCK, KV_HEADS, HEAD_DIM)
    src = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty((blocks, LAYERS, 2) + shape[3:], dtype=torch.bfloat16, device="cuda").permute(1, 2, 0, 3, 4, 5)
    gen = torch.Generator().manual_seed(3)
    out: dict[str, dict[int, float]] = {"kernel": {}, "rows": {}, "kernel, 1 run": {}, "slices, 1 run": {}}
    for num_tokens in tokens:
        n = -(-num_tokens // BLOCK)
        scattered = [torch.randperm(blocks, generator=gen)[:n].tolist() for _ in range(2)]
        run = [list(range(n)), list(range(n, 2 * n))]
        for path, fn, ids in (("kernel", copy_blocks, scattered), ("rows", kernels.reference.copy_blocks, scattered),
                              ("kernel, 1 run", copy_blocks, run), ("slices, 1 run", None, run)):
            src_ids, dst_ids = torch.tensor(ids, dtype=torch.int32, device="cuda")

            def one(fn=fn, src_ids=src_ids, dst_ids=dst_ids, ids=ids):
                if fn is None:
                    BlockCopy(src, ids[0], dst, ids[1])(range(LAYERS))  # one run: the slices path
                else:
                    fn(src, src_ids, dst, dst_ids, range(LAYERS))
                torch.cuda.synchronize()

            out[path][num_tokens] = _median_s(one, repeats)
    return out


def _nbytes(num_tokens: int) -> int:
    return LAYERS * 2 * num_tokens * KV_HEADS * HEAD_DIM * 2


def _table(title: str, ours: str, mine: dict[int, float], *baselines: tuple[str, dict[int, float]]) -> None:
    head = " | ".join(f"{name} GB/s | ratio" for name, _ in baselines)
    print(f"\n{title}\n| KV size | tokens | {ours} GB/s | {head} |\n|" + " --- |" * (3 + 2 * len(baselines)))
    for num_tokens, secs in mine.items():
        nbytes = _nbytes(num_tokens)
        a = nbytes / secs / 1e9
        cells = [f"{nbytes / b[num_tokens] / 1e9:,.2f} | {a * b[num_tokens] / nbytes * 1e9:.2f}" for _, b in baselines]
        print(f"| {nbytes / 2**20:.0f} MiB | {num_tokens} | {a:,.2f} | " + " | ".join(cells) + " |", flush=True)


def run(args: argparse.Namespace) -> int:
    tokens = [int(t) for t in args.tokens.split(",")]
    os.environ.pop(ZMQ_SECRET_ENV, None)
    if not args.insecure_zmq:
        os.environ[ZMQ_SECRET_ENV] = generate()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"KV handoff, Llama-3-8B KV shape ({LAYERS} layers x {KV_HEADS} KV heads x {HEAD_DIM}, bf16, "
          f"{BLOCK}-token blocks), median of {args.repeats}")
    if "cpu" in args.sections.split(","):
        for transport in args.transports.split(","):
            peer = Peer("cpu", transport, max(tokens), scatter=True)
            try:
                ours, phases = _protocol("cpu", peer, tokens, args.repeats, ipc=False)
                raw, raw4 = _raw(peer, tokens, args.repeats), _raw(peer, tokens, args.repeats, MESSAGE_TARGET)
            finally:
                peer.close()
            _table(f"CPU caches, layer frames over {transport}", "kvrelay frames", ours, ("raw ZMQ, 1 message", raw),
                   ("raw ZMQ, 4 MiB messages", raw4))
            _phase_table(f"CPU caches, layer frames over {transport}", "grant -> last frame queued", phases)
    if "overlap" in args.sections.split(","):
        model = args.overlap_model or ("dummy:llama-3-8b" if device == "cuda" else "dummy:smollm2-135m")
        _overlap(device, model, [int(t) for t in args.overlap_tokens.split(",")], args.repeats)
    if device == "cuda" and "cuda" in args.sections.split(","):
        copy = _device_copy(tokens, args.repeats)
        paths = _copy_paths(tokens, args.repeats)
        _table("GPU block copy alone in one process, scattered blocks, layer-major -> block-major pool view",
               "copy kernel", paths["kernel"], ("row gather + scatter (old)", paths["rows"]), ("d2d copy_", copy))
        _table("GPU block copy alone in one process, one contiguous run of blocks", "copy kernel",
               paths["kernel, 1 run"], ("strided slices (the handoff's path for <= 8 runs)", paths["slices, 1 run"]),
               ("d2d copy_", copy))
        for scatter in (True, False):
            peer = Peer("cuda", "tcp", max(tokens), scatter=scatter)
            try:
                ipc, ipc_phases = _protocol("cuda", peer, tokens, args.repeats, ipc=True, scatter=scatter)
                old, old_phases = {}, {}
                if scatter:  # the same handoff with the copy as the row gather + scatter it was
                    _use_copy("rows")
                    old, old_phases = _protocol("cuda", peer, tokens, args.repeats, ipc=True)
                    _use_copy("kernel")
                staged, staged_phases = _protocol("cuda", peer, tokens, args.repeats, ipc=False) if scatter else ({}, {})
                raw = _raw(peer, tokens, args.repeats) if scatter else {}
                raw4 = _raw(peer, tokens, args.repeats, MESSAGE_TARGET) if scatter else {}
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
                _table("GPU caches, host-staged layer frames over tcp", "kvrelay frames", staged,
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


def _peer_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="the decode-side peer of `kvrelay bench handoff`")
    parser.add_argument("--peer", action="store_true", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--transport", default="tcp", choices=["tcp", "ipc"])
    parser.add_argument("--blocks", type=int, required=True)
    parser.add_argument("--tag", default="0")
    parser.add_argument("--scatter", action="store_true")
    parser.add_argument("--kv-shape", default=f"{LAYERS},{KV_HEADS},{HEAD_DIM}", help="layers,KV heads,head dim")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    return parser.parse_args(argv)


if __name__ == "__main__":  # `kvrelay bench handoff`, or with --peer the decode-side process it starts
    if "--peer" in sys.argv[1:]:
        _peer(_peer_args(sys.argv[1:]))
    else:
        bench = argparse.ArgumentParser(prog="python -m kvrelay.bench.handoff", description=__doc__.split("\n")[0])
        add_args(bench)
        sys.exit(run(bench.parse_args()))
