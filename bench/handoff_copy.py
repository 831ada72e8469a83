"""The GPU block copy of ``kvrelay bench handoff`` alone, in one process: the copy kernel against the row
gather + scatter it replaced, strided slices and a plain device-to-device ``copy_`` of the same bytes."""

import torch

from kvrelay import kernels
from kvrelay.bench.handoff_measure import kv_bytes, median_s
from kvrelay.bench.handoff_peer import BLOCK, HEAD_DIM, KV_HEADS, LAYERS
from kvrelay.shared.handoff.blocks import BlockCopy


def device_copy(tokens: list[int], repeats: int) -> dict[int, float]:
    out = {}
    for num_tokens in tokens:
        src = torch.empty(kv_bytes(num_tokens), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)

        def one(src=src, dst=dst):
            dst.copy_(src)
            torch.cuda.synchronize()

        out[num_tokens] = median_s(one, repeats)
    return out


def use_copy(path: str) -> None:
    """Which block copy the handoff's ``kernels.copy_blocks`` runs on CUDA: the Triton kernel, or its
    torch reference (a row gather + scatter, as the handoff copied before the kernel)."""
    from kvrelay.kernels.triton.copy_blocks import copy_blocks

    kernels.register("copy_blocks", copy_blocks if path == "kernel" else kernels.reference.copy_blocks)


def copy_paths(tokens: list[int], repeats: int) -> dict[str, dict[int, float]]:
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

            out[path][num_tokens] = median_s(one, repeats)
    return out
