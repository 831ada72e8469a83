"""e4m3 GEMM for prefill with both scales in the epilogue: y [M, N] = (xq [M, K] @ wq [N, K].T) * sx[m] * sw[n].

cuBLASLt serves ``torch._scaled_mm`` with row-wise scales through other kernels than with scalar ones, and those
are 9-18% slower at prefill sizes on the H100 (BENCHMARKS.md, 2026-12-07 22:06): the scales' cost is the kernel
choice, not the arithmetic, which is two multiplies per output element. This kernel does the scalar kernel's
work and multiplies in the epilogue.

Persistent: one program per SM walks output tiles NUM_SMS apart, so the last wave is never a partial one and
the next tile's loads overlap this tile's epilogue. Tiles run in groups of GROUP_M row blocks per column block
(the weight tile a group reads stays in the L2 across it). Both operands load through Hopper tensor
descriptors (K-major, as the fp8 tensor cores want both) and the output stores through one.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kvrelay.kernels.triton.utils import interpreting, num_sms


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    warps: int
    stages: int


# fp8 tiles: stages x (block_m + block_n) x block_k bytes of shared memory, plus the bf16 output tile
CONFIGS = {
    "m128_n256_k128": GemmConfig(128, 256, 128, 8, 8, 3),
    "m128_n128_k128": GemmConfig(128, 128, 128, 8, 8, 4),
    "m128_n256_k64": GemmConfig(128, 256, 64, 8, 8, 4),
    "m256_n128_k128": GemmConfig(256, 128, 128, 8, 8, 3),
    "m128_n128_k128_w4": GemmConfig(128, 128, 128, 8, 4, 4),
    "m128_n256_k128_g16": GemmConfig(128, 256, 128, 16, 8, 3),
}
DEFAULT = "m128_n256_k128"
MIN_ROWS = 256  # fewer rows are decode-sized: a few output tiles, where cuBLASLt's split-K kernels win


@triton.jit
def _tile_of(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    # groups of GROUP_M row blocks, column blocks outer within a group: a group shares each weight tile
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_rows
    pid_n = (tile % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _fp8_gemm_kernel(x_desc, w_desc, y_desc, sx_ptr, sw_ptr, M, N, K, NUM_PROGRAMS: tl.constexpr,
                     UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_of(tile, tiles_m, tiles_n, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kt in range(k_tiles):
            x = x_desc.load([pid_m * BLOCK_M, kt * BLOCK_K])  # [BLOCK_M, BLOCK_K] e4m3
            w = w_desc.load([pid_n * BLOCK_N, kt * BLOCK_K])  # [BLOCK_N, BLOCK_K] e4m3
            if UPCAST:  # the interpreter has no fp8 dot
                acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        sx = tl.load(sx_ptr + rm, mask=rm < M, other=0.0)  # [BLOCK_M] fp32
        sw = tl.load(sw_ptr + rn, mask=rn < N, other=0.0)  # [BLOCK_N] fp32
        acc = acc * sx[:, None] * sw[None, :]
        y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(y_desc.dtype))


def fits(xq: torch.Tensor, weight: torch.Tensor) -> bool:
    """Prefill-sized rows of a K-contiguous e4m3 activation and weight whose rows are 16-byte aligned."""
    return (xq.shape[0] >= MIN_ROWS and xq.stride(-1) == 1 and weight.stride(-1) == 1 and xq.shape[1] % 16 == 0
            and weight.shape[0] % 8 == 0 and xq.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16, config: GemmConfig | str | None = None) -> torch.Tensor:
    """xq [M, K] e4m3 with fp32 row scales x_scale [M, 1] or [M] @ weight [N, K] e4m3 with fp32 scales [N]
    -> [M, N] in out_dtype (bf16 or fp16). bf16 operands run the same schedule (bench/quant_kernels.py's
    ``bf16_triton`` sets it beside cuBLAS's bf16 GEMM), at half the K tile for the same shared memory."""
    m, k = xq.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"activation has {k} features, the weight {weight.shape[1]}")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fp8_gemm writes bf16 or fp16, not {out_dtype}")
    cfg = CONFIGS[config] if isinstance(config, str) else config or CONFIGS[DEFAULT]
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return y
    x_desc = TensorDescriptor.from_tensor(xq, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
    y_desc = TensorDescriptor.from_tensor(y, [cfg.block_m, cfg.block_n])
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    programs = min(tiles, num_sms(xq.device))
    _fp8_gemm_kernel[(programs,)](
        x_desc, w_desc, y_desc, x_scale.reshape(-1).float(), w_scale.reshape(-1).float(), m, n, k,
        NUM_PROGRAMS=programs, UPCAST=interpreting(), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, num_warps=cfg.warps, num_stages=cfg.stages)
    return y
