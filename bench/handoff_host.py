"""The host side of one CUDA IPC handoff, piece by piece, in one process: ``python -m kvrelay.bench.handoff_host``.

``bench/handoff_trace.py`` shows where a 256 MiB handoff's time goes between stamps; this times what runs between
them on the prefill side — planning the block copy (runs, block ids to the device), launching it, the prompt's
block hashes, the header's encode and decode — each as the handoff does it today and as the alternatives below
would, over the same blocks (scattered, as a long-running worker's free list hands them out). Median host
microseconds per call; the device is synchronised between calls and outside the timing.
"""

import argparse
import hashlib
import random
import statistics
import time
from array import array

import torch

from kvrelay import kernels
from kvrelay.bench.handoff_peer import BLOCK, HEAD_DIM, KV_HEADS, LAYERS
from kvrelay.shared.handoff.blocks import BlockCopy, block_runs
from kvrelay.shared.handoff.direct import DeviceCopy
from kvrelay.shared.handoff.standalone import synthetic_job
from kvrelay.shared.wire.block_hash import block_hash_chain
from kvrelay.shared.wire.codec import decode_any, encode
from kvrelay.shared.wire.handoff import KVHeader


def median_us(fn, repeats: int, sync) -> float:
    for _ in range(3):
        fn()
        sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        sync()
    return statistics.median(times) * 1e6


def hash_chain_three_updates(tokens: list[int], block_size: int, salt: str | None, max_blocks: int) -> list[int]:
    """The same chain hashed as it was before block_hash.py joined the bytes: three sha256 updates a block."""
    chain, parent = [], None
    for b in range(min(len(tokens) // block_size, max_blocks)):
        h = hashlib.sha256()
        h.update(b"\x00" if parent is None else b"\x01" + parent.to_bytes(8, "little"))
        h.update(array("q", tokens[b * block_size:(b + 1) * block_size]).tobytes())
        h.update(b"\x00" if salt is None else b"\x01" + salt.encode())
        parent = int.from_bytes(h.digest()[:8], "little")
        chain.append(parent)
    return chain


def pieces_for(num_tokens: int, dev: torch.device, rng: random.Random) -> dict:
    """What each row times, for a prompt of ``num_tokens`` (a closure per piece over its own tensors)."""
    n = num_tokens // BLOCK
    pool = 4 * n + 16
    src = torch.zeros((LAYERS, 2, pool, BLOCK, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16, device=dev)
    dst = torch.zeros_like(src)
    s, d = rng.sample(range(pool), n), rng.sample(range(pool), n)
    ids = torch.tensor([s, d], dtype=torch.int32, device=dev)
    prompt = [rng.randrange(50_000) for _ in range(num_tokens)]
    pinned = torch.empty(2 * n, dtype=torch.int32, pin_memory=dev.type == "cuda")

    def staged_ids():
        pinned.numpy()[:] = array("i", s + d)
        return pinned.to(dev, non_blocking=True)

    job = synthetic_job("r1", num_tokens, "m")
    job.prompt_token_ids = prompt
    header = KVHeader(job=job, num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK,
                      num_blocks=n, block_ids=d, dtype="bfloat16", transport="ipc", nbytes=0, first_token_id=1,
                      first_logprob=None, first_top_logprobs=None, prompt_logprobs=None, num_cached_tokens=0)
    wire = encode(header)
    pin = (lambda t: t.pin_memory()) if dev.type == "cuda" else (lambda t: t)
    pieces = {
        "BlockCopy(...) (plan: runs, ids to the device)": lambda: BlockCopy(src, s, dst, d),
        "  block_runs": lambda: block_runs(s, d),
        "  block_runs up to 8 runs": lambda: block_runs(s, d, 8),
        "  torch.tensor(ids) (the plan before)": lambda: torch.tensor([s, d], dtype=torch.int32),
        "  torch.tensor(ids).pin_memory()": lambda: pin(torch.tensor([s, d], dtype=torch.int32)),
        "  ... .to(device, non_blocking)": lambda: pin(torch.tensor([s, d], dtype=torch.int32)).to(
            dev, non_blocking=True),
        "  frombuffer(array) -> pin -> to (the plan now)": lambda: pin(
            torch.frombuffer(array("i", s + d), dtype=torch.int32)).to(dev, non_blocking=True),
        "  one pinned buffer, filled -> to": staged_ids,
        "  range checks (any over ids)": lambda: any(not 0 <= b < pool for b in d),
        "  range checks (min, max)": lambda: 0 <= min(d) and max(d) < pool,
        "kernels.copy_blocks launch": lambda: kernels.copy_blocks(src, ids[0], dst, ids[1], range(LAYERS)),
        "DeviceCopy(...) (plan + launch on the side stream)": lambda: DeviceCopy(src, s, dst, d),
        "block_hash_chain": lambda: block_hash_chain(prompt, BLOCK, None, 4096),
        "  the same, three sha256 updates a block": lambda: hash_chain_three_updates(prompt, BLOCK, None, 4096),
        "KVHeader encode": lambda: encode(header),
        "KVHeader decode": lambda: decode_any(wire, KVHeader),
    }
    if dev.type == "cuda":
        side = torch.cuda.Stream(dev)

        def side_ops():
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                torch.cuda.Event().record(side)

        pieces["side stream: wait, enter, event record"] = side_ops
    return pieces


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="256,2048")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rng = random.Random(0)
    rows = []
    for num_tokens in map(int, args.tokens.split(",")):
        pieces = pieces_for(num_tokens, dev, rng)
        for name, fn in pieces.items():
            rows.append((num_tokens, num_tokens // BLOCK, name, median_us(fn, args.repeats, sync)))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"host microseconds per call, median of {args.repeats} ({name})")
    print("| tokens | blocks | piece | us |")
    print("| --- | --- | --- | --- |")
    for num_tokens, n, name, us in rows:
        print(f"| {num_tokens} | {n} | {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
