"""``kvrelay bench rank-handoff``: the KV handoff of a tensor-parallel prefill engine, each rank sending its own
KV heads (transport "rank_layers", shared/engine/ranks/kv_parts.py) against the same engine gathering every
rank's heads to rank 0 first (the path it takes without links for its ranks), in the same run.

A real TP-N prefill ``EngineCore`` (one process per rank, one GPU each on CUDA) prefills a prompt of each
length; a real ``HandoffManager`` hands its KV off over CURVE ZMQ (loopback TCP) to a real ``HandoffReceiver``
over a one-rank decode cache of every KV head (on the device after the prefill's last one), both polled from
this thread. One transfer is timed from the HandoffRequest to the ack; the prefill before it is not. Every
number is the median of ``--repeats`` timed transfers after one warm-up; GB/s = 1e9 bytes/s.

Not yet measured: this machine's CI has no GPU. Run on a host with N GPUs, e.g.
``kvrelay bench rank-handoff --tp 2 --device cuda --model dummy:llama-3-8b``.
"""

import argparse
import statistics
import time
from types import SimpleNamespace

import torch
import zmq

from kvrelay.decode_worker.receiver import HandoffReceiver
from kvrelay.prefill_worker.handoff import FirstToken, HandoffManager, State
from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig
from kvrelay.shared.config.zmq_secret import generate
from kvrelay.shared.engine.engine_core import EngineCore
from kvrelay.shared.engine.kv_connector import KVLinks
from kvrelay.shared.handoff.frames import Frames, max_message_bytes
from kvrelay.shared.handoff.standalone import decode_info, endpoint, serves, synthetic_job
from kvrelay.shared.wire import zmq_auth
from kvrelay.shared.wire.sampling_params import SamplingParams
from kvrelay.shared.wire.zmq_auth import keys_from_secret

MODEL = "bench-rank-kv"
BLOCK = 16


def _engine(args: argparse.Namespace, keys) -> EngineCore:
    dummy = args.model.startswith("dummy:")
    config = EngineConfig(ModelConfig(args.model, dtype=args.dtype, max_model_len=max(args.tokens) + 16,
                                      load_format="dummy" if dummy else "auto"),
                          cache=CacheConfig(block_size=BLOCK, num_gpu_blocks=args.blocks), device=args.device,
                          tensor_parallel_size=args.tp)
    return EngineCore(config, hold_finished_kv=True, kv_links=KVLinks.of(keys))


def _one(core: EngineCore, manager: HandoffManager, receiver: HandoffReceiver, rid: str, num_tokens: int,
         by_rank: bool) -> tuple[float, int, str]:
    """(seconds from the ask to the ack, KV bytes, transport) of one handoff of a freshly prefilled prompt."""
    prompt = [(7 * i + 3) % (core.vocab_size - 10) + 10 for i in range(num_tokens)]
    core.add_request(core.make_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1)))
    while core.has_unfinished():
        core.step()
    # the same engine either way: without its send hook, a sharded EngineKV gathers to rank 0 (sharded.py)
    saved = core.kv._send_parts
    if not by_rank:
        core.kv._send_parts = None
    try:
        start = time.perf_counter()
        manager.start(synthetic_job(rid, num_tokens, MODEL), rid.encode(), FirstToken(2))
        while True:
            receiver.poll(0, lambda h: None)
            ended = [t for t in manager.poll(0) if t.job.request_id == rid]
            if ended:
                break
        took = time.perf_counter() - start
    finally:
        core.kv._send_parts = saved
    (t,) = ended
    if t.state is not State.DONE:
        raise RuntimeError(f"handoff of {rid} failed: {t.reason}")
    receiver.core_for(MODEL).kv.free(rid)
    return took, t.nbytes, t.transport


def run(args: argparse.Namespace) -> int:
    args.tokens = [int(t) for t in args.tokens.split(",")]
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    keys = keys_from_secret(generate())
    core = _engine(args, keys)
    ctx = zmq.Context()
    try:
        kv = core.kv
        decode_device = f"cuda:{args.tp}" if args.device == "cuda" and torch.cuda.device_count() > args.tp else args.device
        cache = torch.zeros((kv.num_layers, 2, args.blocks, BLOCK, kv.num_kv_heads, kv.kv_cache.shape[5]),
                            dtype=kv.kv_cache.dtype, device=decode_device)
        decode = endpoint(cache, "bench-decode", MODEL)
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes(cache, args.blocks))
        zmq_auth.serve(sock, keys)
        addr = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
        receiver = HandoffReceiver(sock, serves(MODEL, decode.core), 60.0, transports=[Frames()])
        manager = HandoffManager(ctx, SimpleNamespace(core=core, config=SimpleNamespace(worker_id="bench-prefill"),
                                                      redis=None),
                                 60.0, workers=lambda: [decode_info(addr, MODEL)], transports=[Frames()], curve=keys)
        print(f"KV handoff of a TP {args.tp} prefill ({args.model}, {args.dtype}, {args.device}) to one decode "
              f"cache on {decode_device}, median of {args.repeats}\n| tokens | KV MiB | rank 0 gathers GB/s | "
              "each rank sends GB/s | ratio |\n| --- | --- | --- | --- | --- |")
        n = 0
        for num_tokens in args.tokens:
            times = {}
            for by_rank in (False, True):
                runs = []
                for i in range(args.repeats + 1):
                    n += 1
                    took, nbytes, transport = _one(core, manager, receiver, f"r{n}", num_tokens, by_rank)
                    assert transport == ("rank_layers" if by_rank else "layers"), transport
                    if i:
                        runs.append(took)
                times[by_rank] = statistics.median(runs)
            gathered, ranks = (nbytes / times[b] / 1e9 for b in (False, True))
            print(f"| {num_tokens} | {nbytes / 2**20:.1f} | {gathered:.2f} | {ranks:.2f} | {ranks / gathered:.2f} |",
                  flush=True)
        manager.close()
    finally:
        core.shutdown()
        ctx.destroy(linger=0)
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="dummy:llama-3-8b", help="HF directory or dummy:<preset>")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--tokens", default="256,1024,2048", help="prompt lengths")
    p.add_argument("--blocks", type=int, default=1024, help="KV blocks of each cache (16 tokens each)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])


if __name__ == "__main__":  # `kvrelay bench rank-handoff`
    parser = argparse.ArgumentParser()
    add_args(parser)
    raise SystemExit(run(parser.parse_args()))
