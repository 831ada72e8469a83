"""The weight-only quantized matmuls as registered on CUDA: the fused kernels for few rows, and for many
rows the whole weight dequantized (kernels/triton/dequant.py) and multiplied by cuBLAS, as vLLM does for AWQ.

Why two paths: the fused kernels (w4_decode.py, w4a16.py) read 4 or 8 bits a weight, which is what bounds a
decode step; but they dequantize every weight tile once per tile of rows, in registers, and at prefill sizes
that work and their tiles lose to cuBLAS's bf16 matmul, while dequantizing once costs a read of the packed
weight and a write and read of the bf16 one, small beside a matmul of many rows. ``DEQUANT_MIN_ROWS`` is
where the second path starts.

The dequantized weight goes to one scratch buffer per device, sized by the largest layer it has held and
kept: every layer's call reuses it, with no allocation per call. One buffer is enough because a model's
forwards on a device are issued in order on one stream (CUDA-graph replays included): each layer's matmul
has read it before the next layer's dequantization writes it.

CUDA graphs: a capture uses the buffer as it stands (the engine runs each graph's shapes eagerly before
capturing them, so the buffer is large enough by then) and marks it captured, since a graph replays into
that address: when a later eager call needs a larger buffer, a captured one is kept alive (``_retired``),
never freed for the allocator to hand to another tensor. A capture that finds the buffer too small does not
grow it (a buffer allocated under capture belongs to that graph's private pool); it takes a plain
``torch.empty`` for the call, which the caching allocator serves from the graph's pool: memory reserved for
that graph's replays, shared with no eager tensor, and reused by the capture's later allocations only in
the order the replay runs them.
"""

import os

import torch
import torch.nn.functional as F

from kvrelay.kernels.triton import dequant, w4_decode, w4a16
from kvrelay.kernels.w4_repack import W4Packed


def _min_rows() -> int:
    # read once, at import, as KVRELAY_KERNELS is (kernels/registry.py): a knob for benchmarks, not a setting
    raw = os.environ.get("KVRELAY_DEQUANT_MIN_ROWS", "256")
    if not raw.isdigit():
        raise ValueError(f"KVRELAY_DEQUANT_MIN_ROWS must be a row count (an integer >= 0), not {raw!r}")
    return int(raw)


# Rows from which a weight is dequantized whole. Few rows are bound by reading the weight, where the fused kernels
# read 4 or 8 bits a weight and the dequantized path reads the packed weight, writes 16 bits and reads them again;
# many rows are bound by the matmul's arithmetic, where cuBLAS's tiles beat the fused ones and that fixed cost
# fades. 256 is vLLM's cut-over for AWQ, the starting value: bench/quant_crossover.py times both
# paths at each row count and Llama-3-8B shape, which is what to set it from
DEQUANT_MIN_ROWS = _min_rows()

_scratch: dict[torch.device, torch.Tensor] = {}  # bytes, per device
_captured: set[torch.device] = set()  # devices whose current buffer a CUDA graph has recorded
_retired: list[torch.Tensor] = []  # captured buffers outgrown: graphs still replay into them


def scratch(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous ``shape`` tensor of ``dtype`` over the device's scratch buffer (module docstring)."""
    nbytes = shape[0] * shape[1] * dtype.itemsize
    buf = _scratch.get(device)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if buf is None or buf.numel() < nbytes:
        if capturing:
            return torch.empty(shape, dtype=dtype, device=device)
        if buf is not None and device in _captured:
            _retired.append(buf)
        elif buf is not None and device.type == "cuda":
            # freed once the work queued on this stream has read it, whichever stream allocated it
            buf.record_stream(torch.cuda.current_stream(device))
        _captured.discard(device)
        buf = _scratch[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if capturing:
        _captured.add(device)
    return buf[:nbytes].view(dtype).view(shape)


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def w4_packed_linear(x: torch.Tensor, p: W4Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    if _rows(x) < DEQUANT_MIN_ROWS:
        return w4_decode.w4_packed_linear(x, p, bias)
    n, k = p.shape
    w = dequant.dequantize_w4_packed(p, x.dtype, scratch((k, n), x.dtype, x.device))
    return F.linear(x, w.t(), bias)


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                 group_size: int, g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    if _rows(x) < DEQUANT_MIN_ROWS:
        return w4a16.w4a16_linear(x, qweight, zeros, scales, group_size, g_idx, bias)
    out = scratch((qweight.shape[0] * 8, qweight.shape[1]), x.dtype, x.device)
    w = dequant.dequantize_w4(qweight, zeros, scales, group_size, g_idx, x.dtype, out)
    return F.linear(x, w.t(), bias)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    if _rows(x) < DEQUANT_MIN_ROWS:
        return w4a16.int8_linear(x, weight, scale, bias)
    w = dequant.dequantize_channel(weight, scale, x.dtype, scratch(tuple(weight.shape), x.dtype, x.device))
    return F.linear(x, w, bias)
