"""bf16/fp16 ``x @ w.T`` for 16-256 rows (batched decode), streaming the weight once at copy speed.

At these row counts a projection is bound by reading ``w`` [N, K] from HBM, and what cuBLAS loses is
scheduling: output tiles that fill the SMs in 1.7 waves (gate|up's 224 tiles of 128x128 on 132 SMs), or a
split-K whose reduction is a launch of its own. Three schedules of the same K loop (``_tile_dot``):

- ``split``: ``SPLIT`` programs share the K loop of one output tile, SPLIT chosen so that the programs fill
  whole waves of the SMs without more partial-sum traffic than that saves (``_choose_split``); fp32
  partials go to a [SPLIT, M, N] scratch that w4_fast's ``_split_sum_kernel`` adds in a fixed order (the
  same bits every run); one split stores the output directly.
- ``atomic``: the same grid, partials ``atomic_add``-ed into a zeroed fp32 [M, N] (a memset, the kernel, a
  cast): no scratch of SPLIT x the output, but the order of the additions (and so the bits) may vary.
- ``persistent``: stream-K. One program per resident slot walks a contiguous range of the flattened
  (tile, K tile) iterations, so every program streams the same number of weight bytes whatever the tile
  count; a range that ends inside a tile adds its partial by atomics, as ``atomic`` does.

Each schedule loads its tiles by pointer arithmetic or, ``tma`` configs, through Hopper tensor descriptors
built on the host (``TensorDescriptor``: passed by value, so a CUDA graph replays them with no allocator).

Programs run rows fastest (``pid_m``): the programs that read one weight tile for the row blocks of a
256-row batch run together, so the weight comes from HBM once and from the L2 after. Loads wrap rows and
columns past the edge (``% M``, ``% N``) instead of masking them, keeping the loads unpredicated; only the
stores mask. Every sum is fp32; the output is cast once, after the split-K reduction.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kvrelay.kernels.triton.decode_attention import _dot
from kvrelay.kernels.triton.utils import interpreting, num_sms, rows_view
from kvrelay.kernels.triton.w4_fast import SUM_BLOCK, _split_sum_kernel

VARIANTS = ("split", "atomic", "persistent")
SMEM_PER_SM = 227 * 1024  # H100/H200 shared memory a block may use: how many programs an SM holds
MIN_TILES_PER_SPLIT = 4  # a split shorter than this spends its time filling and draining the pipeline
MAX_SPLIT = 16


@dataclass(frozen=True)
class MidConfig:
    """One schedule. ``block_m`` caps the row tile (fewer rows take a smaller power of two, at least 16);
    ``split``: K splits per output tile (split, atomic) or programs in all (persistent); 0 picks it from
    the SM count. ``tma``: load the tiles through Hopper tensor descriptors (the TMA unit computes the
    addresses and zero-fills past the edges) instead of pointer arithmetic; needs K a multiple of 8."""

    variant: str
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    split: int = 0
    tma: bool = False


# shared memory per program at the 128-row tile: stages x (block_m + block_n) x block_k x 2 bytes <= 192 KiB
CONFIGS = {
    "split_n64_k128": MidConfig("split", 128, 64, 128, 4, 4),
    "split_n64_k64": MidConfig("split", 128, 64, 64, 4, 6),
    "split_n128_k64": MidConfig("split", 128, 128, 64, 4, 5),
    "split_n128_k128": MidConfig("split", 128, 128, 128, 8, 3),
    "split_n256_k64": MidConfig("split", 128, 256, 64, 8, 4),
    "split_m64_n128_k128": MidConfig("split", 64, 128, 128, 4, 4),
    "atomic_n64_k128": MidConfig("atomic", 128, 64, 128, 4, 4),
    "atomic_n128_k64": MidConfig("atomic", 128, 128, 64, 4, 5),
    "atomic_n128_k128": MidConfig("atomic", 128, 128, 128, 8, 3),
    "persistent_n64_k128": MidConfig("persistent", 128, 64, 128, 4, 4),
    "persistent_n128_k64": MidConfig("persistent", 128, 128, 64, 4, 5),
    "persistent_n128_k128": MidConfig("persistent", 128, 128, 128, 8, 3),
    "persistent_n256_k64": MidConfig("persistent", 128, 256, 64, 8, 4),
    "split_n128_k64_tma": MidConfig("split", 128, 128, 64, 4, 5, tma=True),
    "split_n256_k64_tma": MidConfig("split", 128, 256, 64, 8, 4, tma=True),
    "persistent_n128_k64_tma": MidConfig("persistent", 128, 128, 64, 4, 5, tma=True),
}
QUICK = ("split_n64_k128", "split_n128_k64", "atomic_n128_k64", "persistent_n128_k64", "split_n128_k64_tma")


@triton.jit
def _tile_dot(x_ptr, w_ptr, pid_m, pid_n, kt0, kt1, M, N, K, stride_x, stride_w, TMA: tl.constexpr,
              EVEN_K: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    # fp32 [BLOCK_M, BLOCK_N] = x[rows, K tiles kt0..kt1) @ w[cols, same K].T
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if TMA:  # x_ptr, w_ptr: tensor descriptors of x [M, K] and w [N, K], zeros past every edge
        for kt in range(kt0, kt1):
            x = x_ptr.load([pid_m * BLOCK_M, kt * BLOCK_K])
            w = w_ptr.load([pid_n * BLOCK_N, kt * BLOCK_K])  # [BLOCK_N, BLOCK_K]
            acc += _dot(x, tl.trans(w), UPCAST, False)
    else:
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M  # wrapped: duplicate rows, never stored
        rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        rk = kt0 * BLOCK_K + tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_x + rk[None, :]  # [BLOCK_M, BLOCK_K]
        w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_w + rk[:, None]  # [BLOCK_K, BLOCK_N]: w.T's tile
        for kt in range(kt0, kt1):
            if EVEN_K:
                x = tl.load(x_ptrs)
                w = tl.load(w_ptrs)
            else:
                k_ok = kt * BLOCK_K + tl.arange(0, BLOCK_K) < K
                x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            acc += _dot(x, w, UPCAST, False)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    return acc


@triton.jit
def _out_offsets(pid_m, pid_n, M, N, stride_y, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return rm[:, None].to(tl.int64) * stride_y + rn[None, :], (rm < M)[:, None] & (rn < N)[None, :], rn


@triton.jit
def _split_k_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y, stride_split, K_TILES,
                    TILES_PER_SPLIT, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, TMA: tl.constexpr, EVEN_K: tl.constexpr,
                    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kt0 = pid_k * TILES_PER_SPLIT
    acc = _tile_dot(x_ptr, w_ptr, pid_m, pid_n, kt0, tl.minimum(kt0 + TILES_PER_SPLIT, K_TILES), M, N, K,
                    stride_x, stride_w, TMA, EVEN_K, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
    offs, mask, rn = _out_offsets(pid_m, pid_n, M, N, stride_y, BLOCK_M, BLOCK_N)
    if HAS_BIAS:  # one split, stored as the output: split partials get it in the sum
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if ATOMIC:
        tl.atomic_add(y_ptr + offs, acc, mask=mask, sem="relaxed")
    else:  # y: the output, or this split's fp32 slot of the scratch
        tl.store(y_ptr + pid_k.to(tl.int64) * stride_split + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _stream_k_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y, K_TILES, TILES_M, ITERS,
                     ITERS_PER_PROGRAM, TMA: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # iterations: (tile, K tile) flattened K tile fastest, tiles row block fastest; y: zeroed fp32 [M, N]
    it = tl.program_id(0) * ITERS_PER_PROGRAM
    end = tl.minimum(it + ITERS_PER_PROGRAM, ITERS)
    while it < end:
        tile = it // K_TILES
        kt0 = it % K_TILES
        kt1 = tl.minimum(K_TILES, kt0 + end - it)
        pid_m, pid_n = tile % TILES_M, tile // TILES_M
        acc = _tile_dot(x_ptr, w_ptr, pid_m, pid_n, kt0, kt1, M, N, K, stride_x, stride_w, TMA, EVEN_K, UPCAST,
                        BLOCK_M, BLOCK_N, BLOCK_K)
        offs, mask, _ = _out_offsets(pid_m, pid_n, M, N, stride_y, BLOCK_M, BLOCK_N)
        tl.atomic_add(y_ptr + offs, acc, mask=mask, sem="relaxed")
        it += kt1 - kt0


def _slots(cfg: MidConfig, block_m: int, device: torch.device) -> int:
    """Programs resident at once on the device, as their pipeline buffers in shared memory allow."""
    smem = cfg.stages * (block_m + cfg.block_n) * cfg.block_k * 2
    return num_sms(device) * max(1, SMEM_PER_SM // smem)


def _choose_split(tiles: int, k_tiles: int, slots: int, weight_bytes: int, out_bytes: int) -> int:
    """The split with the least bytes per resident slot: the weight over whole waves of programs (a last
    wave half full costs a full wave) plus, past one split, the fp32 partials written and read back."""
    def cost(split: int) -> float:
        programs = tiles * split
        partials = 2 * split * out_bytes if split > 1 else 0
        return triton.cdiv(programs, slots) * weight_bytes / programs + partials / slots

    return min(range(1, min(MAX_SPLIT, max(1, k_tiles // MIN_TILES_PER_SPLIT)) + 1), key=cost)


def default_config(m: int, n: int, k: int, device: torch.device) -> MidConfig:
    """A first choice, before GPU numbers: bench/mid_gemm.py prints the best named config per shape."""
    return CONFIGS["split_n128_k64"]


def mid_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
               config: MidConfig | str | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K].T (+ bias [N]) -> [..., N] in x's dtype (fp16 or bf16, w the same)."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the weight {k}")
    if x.dtype not in (torch.float16, torch.bfloat16) or w.dtype != x.dtype:
        raise ValueError(f"mid_linear takes fp16 or bf16 x and w of one dtype, not {x.dtype} and {w.dtype}")
    if w.stride(1) != 1:
        raise ValueError("mid_linear needs the weight's rows contiguous (nn.Linear layout)")
    x2 = rows_view(x)
    m = x2.shape[0]
    cfg = CONFIGS[config] if isinstance(config, str) else config or default_config(m, n, k, x.device)
    if cfg.variant not in VARIANTS:
        raise ValueError(f"unknown mid_linear variant {cfg.variant!r}; one of {VARIANTS}")
    if cfg.tma and (k % 8 or w.stride(0) % 8 or x2.data_ptr() % 16 or w.data_ptr() % 16):
        raise ValueError("a tma config needs K a multiple of 8 and 16-byte aligned rows of x and w")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    block_m = min(cfg.block_m, max(16, triton.next_power_of_2(m)))
    tiles_m, tiles_n, k_tiles = triton.cdiv(m, block_m), triton.cdiv(n, cfg.block_n), triton.cdiv(k, cfg.block_k)
    slots = _slots(cfg, block_m, x.device)
    xa, wa = x2, w
    if cfg.tma:
        xa = TensorDescriptor.from_tensor(x2, [block_m, cfg.block_k])
        wa = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
    common = dict(TMA=cfg.tma, EVEN_K=k % cfg.block_k == 0, UPCAST=interpreting(), BLOCK_M=block_m, BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, num_warps=cfg.warps, num_stages=cfg.stages)
    bias_or_any = bias if bias is not None else w
    if cfg.variant == "persistent":
        iters = tiles_m * tiles_n * k_tiles
        per_program = triton.cdiv(iters, cfg.split or slots)
        acc = torch.zeros((m, n), dtype=torch.float32, device=x.device)
        _stream_k_kernel[(triton.cdiv(iters, per_program),)](
            xa, wa, acc, m, n, k, x2.stride(0), w.stride(0), acc.stride(0), k_tiles, tiles_m, iters, per_program,
            **common)
    else:
        split = cfg.split or _choose_split(tiles_m * tiles_n, k_tiles, slots, w.numel() * w.element_size(), m * n * 4)
        per_split = triton.cdiv(k_tiles, min(split, k_tiles))
        split = triton.cdiv(k_tiles, per_split)  # no program without a K tile: every scratch slot is written
        if cfg.variant == "atomic":
            acc = torch.zeros((m, n), dtype=torch.float32, device=x.device)
        else:
            acc = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        _split_k_kernel[(tiles_m, tiles_n, split)](
            xa, wa, bias_or_any, acc, m, n, k, x2.stride(0), w.stride(0), n, m * n, k_tiles, per_split,
            HAS_BIAS=bias is not None and acc is y, ATOMIC=cfg.variant == "atomic", **common)
        if acc is y:
            return y.view(*x.shape[:-1], n)
    # fp32 sums in acc ([split, M, N] slots, or the one [M, N] atomics add into): added in order, bias, one cast
    _split_sum_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](acc, bias_or_any, y, m * n, n, acc.numel() // (m * n),
                                                        HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK)
    return y.view(*x.shape[:-1], n)
