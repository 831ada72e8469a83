"""The overlap section of ``kvrelay bench handoff``: a real prefill engine's KV streamed to the decode-side
peer layer by layer during the prompt's last chunk, against the same KV sent after the prefill."""

import statistics
import time
from types import SimpleNamespace

import torch
import zmq

from kvrelay.bench.handoff_peer import BLOCK, MODEL, Peer
from kvrelay.prefill_worker.handoff import FirstToken, HandoffManager, State
from kvrelay.shared.handoff.blocks import DTYPE_NAMES, frame_nbytes
from kvrelay.shared.handoff.standalone import decode_info, synthetic_job


def overlap(device: str, model: str, tokens: list[int], repeats: int) -> dict[int, dict[bool, list[float]]]:
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
                             curve=peer.keys)
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
