"""The published 4-bit checkpoint layouts, to and from the W4 layout the kernels read (kernels/quant.py),
and a round-to-nearest group quantizer that writes them (``kvrelay models import --quantization awq``,
and the tests' own int4 checkpoints of real weights).

- AutoAWQ GEMM: ``qweight`` int32 [K, N/8] and ``qzeros`` int32 [K/G, N/8] pack eight 4-bit values along
  the output dimension in the interleaved order 0 2 4 6 1 3 5 7 (word slot i holds column 8c +
  AWQ_ORDER[i]); ``scales`` fp16 [K/G, N]; ``w = (q - z) * s``.
- GPTQ: ``qweight`` int32 [K/8, N] packs along the input dimension in order (already the W4 layout);
  ``qzeros`` int32 [K/G, N/8] packs along the output dimension in order, each zero point stored minus one
  in the original (v1) format; ``scales`` fp16 [K/G, N]; ``g_idx`` int32 [K].
"""

import torch

from kvrelay.kernels.quant import PACK, pack_w4, unpack_w4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _unpack_cols(t: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    # int32 [R, C/8] -> values 0..15 [R, C], word slot i going to column 8c + order[i]
    rows, words = t.shape
    out = torch.empty(rows, words, PACK, dtype=torch.int32, device=t.device)
    for slot, col in enumerate(order):
        out[:, :, col] = (t >> (4 * slot)) & 0xF
    return out.reshape(rows, words * PACK)


def _pack_cols(q: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    rows, cols = q.shape
    q = q.to(torch.int32).reshape(rows, cols // PACK, PACK)
    out = torch.zeros(rows, cols // PACK, dtype=torch.int32, device=q.device)
    for slot, col in enumerate(order):
        out |= q[:, :, col] << (4 * slot)
    return out


SEQUENTIAL = tuple(range(PACK))


def awq_qweight_to_w4(qweight: torch.Tensor) -> torch.Tensor:
    """AWQ qweight [K, N/8] -> W4 qweight [K/8, N]."""
    return pack_w4(_unpack_cols(qweight, AWQ_ORDER))


def awq_qzeros_to_w4(qzeros: torch.Tensor) -> torch.Tensor:
    """AWQ qzeros [K/G, N/8] -> zero points uint8 [K/G, N]."""
    return _unpack_cols(qzeros, AWQ_ORDER).to(torch.uint8)


def gptq_qzeros_to_w4(qzeros: torch.Tensor, minus_one: bool) -> torch.Tensor:
    """GPTQ qzeros [K/G, N/8] -> zero points uint8 [K/G, N] (v1 stores them minus one, wrapping 0 to 15)."""
    z = _unpack_cols(qzeros, SEQUENTIAL)
    return ((z + 1) & 0xF if minus_one else z).to(torch.uint8)


# each group's range scaled by these around its centre, the one with the least squared error kept: a step
# a little off the plain (max - min) / 15 moves the grid against the weights' own (the search AWQ's and
# GPTQ's tooling run over clipping ranges, here without calibration data)
RANGE_RATIOS = (0.96, 0.98, 1.0, 1.02, 1.04, 1.06)


def rtn_w4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest 4-bit quantization of a [N, K] weight in groups of ``group_size`` inputs,
    each group's range chosen among ``RANGE_RATIOS`` by least squared error: (q [K, N] values 0..15, zero
    points [K/G, N] 0..15, fp16 scales [K/G, N]). No calibration data: the baseline AWQ and GPTQ improve
    on, and a faithful exercise of their layouts and kernels."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the input size {k}")
    w = weight.float().t().reshape(k // group_size, group_size, n)  # [K/G, G, N]
    lo, hi = w.amin(dim=1), w.amax(dim=1)
    mid, span = (hi + lo) / 2, hi - lo
    best: tuple[torch.Tensor, ...] | None = None
    for ratio in RANGE_RATIOS:
        scales = (span * ratio / 15).clamp(min=1e-8).half()
        s = scales.float()
        zeros = (-(mid - span * ratio / 2) / s).round().clamp(0, 15)
        q = (w / s[:, None] + zeros[:, None]).round().clamp(0, 15)
        err = ((q - zeros[:, None]) * s[:, None] - w).pow(2).sum(dim=1)  # [K/G, N]
        if best is None:
            best = (err, q, zeros, scales)
            continue
        better = err < best[0]
        best = (torch.where(better, err, best[0]), torch.where(better[:, None], q, best[1]),
                torch.where(better, zeros, best[2]), torch.where(better, scales, best[3]))
    _, q, zeros, scales = best
    return q.reshape(k, n).to(torch.int32), zeros.to(torch.int32), scales


def to_awq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """The AutoAWQ GEMM tensors of one layer from ``rtn_w4``'s output."""
    return {"qweight": _pack_cols(q, AWQ_ORDER), "qzeros": _pack_cols(zeros, AWQ_ORDER), "scales": scales}


def to_gptq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """The GPTQ (v1 format, no act-order) tensors of one layer from ``rtn_w4``'s output."""
    k = q.shape[0]
    return {"qweight": pack_w4(q), "qzeros": _pack_cols((zeros - 1) & 0xF, SEQUENTIAL), "scales": scales,
            "g_idx": (torch.arange(k) // group_size).to(torch.int32)}


__all__ = ["AWQ_ORDER", "awq_qweight_to_w4", "awq_qzeros_to_w4", "gptq_qzeros_to_w4", "rtn_w4", "to_awq",
           "to_gptq", "unpack_w4"]
