"""Whether the fp8 KV store rounds on a GPU exactly as torch's float32 -> float8_e4m3fn conversion does.

The KV cache's contract (kernels/kv_quant.py) is torch's rounding: a block written by a Triton kernel and
the same values quantized by torch must be the same bytes. This feeds every e4m3 value, every midpoint
between neighbours (the ties), points just either side of each midpoint, values below the smallest
subnormal, both zeros and values past the clamp through three stores, and through the kernels' own
``write_kv`` at the scales the tests use, and prints how many bytes differ from torch's and the first few:

- ``kernel``: what the kernels store (kernels/triton/write_kv.py ``to_cache``: IEEE division, the grid
  rounding, then the cast);
- ``cast``: Triton's ``/`` and the hardware conversion alone;
- ``recip``: a multiply by Triton's reciprocal of the scale before the grid rounding.

``python -m kvrelay.bench.fp8_cast_probe`` on a CUDA machine.
"""

import torch
import triton
import triton.language as tl

from kvrelay.kernels import kv_quant
from kvrelay.kernels.triton.write_kv import _e4m3_grid, to_cache

FP8 = torch.float8_e4m3fn
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run under TRITON_INTERPRET=1


@triton.jit
def _store(x_ptr, out_ptr, scale, N, VARIANT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    x = tl.load(x_ptr + i, mask=m, other=0.0)
    if VARIANT == 0:
        y = to_cache(x, scale, out_ptr.dtype.element_ty, True)
    elif VARIANT == 1:
        y = tl.clamp(x / scale, -448.0, 448.0).to(out_ptr.dtype.element_ty)
    else:
        y = _e4m3_grid(tl.clamp(x * (1.0 / scale), -448.0, 448.0)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + i, y, mask=m)


def probe_values() -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = codes[torch.isfinite(codes)].unique().sort().values  # every finite e4m3 value, ascending
    mids = (grid[1:] + grid[:-1]) / 2
    nudged = torch.cat([mids * (1 + 2.0 ** -20), mids * (1 - 2.0 ** -20)])
    tiny = torch.tensor([2.0 ** -10, 2.0 ** -11, 3 * 2.0 ** -11, -(2.0 ** -10), 0.0, -0.0, 447.9, 448.0, 464.0,
                         500.0, 1e4, -1e4])
    gen = torch.Generator().manual_seed(0)
    rand = torch.randn(200_000, generator=gen) * torch.logspace(-3, 2.7, 200_000)
    return torch.cat([grid, mids, nudged, tiny, rand]).float()


def compare(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, name: str) -> int:
    bad = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero().flatten()
    print(f"{name}: {len(bad)} of {x.numel()} bytes differ from torch", flush=True)
    for i in bad[:8].tolist():
        print(f"    x={x[i].item()!r:>24} kernel={got[i].float().item()!r:>12} (0x{got.view(torch.uint8)[i].item():02x}) "
              f"torch={want[i].float().item()!r:>12} (0x{want.view(torch.uint8)[i].item():02x})")
    return len(bad)


def main() -> None:
    from kvrelay.kernels.triton.write_kv import write_kv

    x = probe_values().to(DEV)
    for scale in (1.0, 0.5, 2.0, 0.37):
        want = kv_quant.quantize(x, torch.tensor(scale, device=DEV))
        for variant, name in enumerate(("kernel", "cast", "recip")):
            out = torch.empty_like(x, dtype=FP8)
            _store[(triton.cdiv(x.numel(), 1024),)](x, out, scale, x.numel(), VARIANT=variant, BLOCK=1024)
            compare(out, want, x, f"scale {scale} {name}")
    # the kernels' own write_kv on rows shaped like a cache's, at the tests' scales
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        gen = torch.Generator().manual_seed(1)
        k = (torch.randn(777, 8, 128, generator=gen) * 20).to(dtype).to(DEV)
        v = (torch.randn(777, 8, 128, generator=gen) * 300).to(dtype).to(DEV)
        scale = torch.tensor([0.5, 2.0], device=DEV)
        cache = torch.zeros(2, 60, 16, 8, 128, dtype=FP8, device=DEV)
        slots = torch.randperm(60 * 16, generator=gen)[:777].to(DEV)
        write_kv(k, v, cache, slots, scale)
        blocks, offs = slots // 16, slots % 16
        compare(cache[0, blocks, offs].flatten(), kv_quant.quantize(k, scale[0]).flatten(), k.float().flatten(),
                f"write_kv {dtype} K")
        compare(cache[1, blocks, offs].flatten(), kv_quant.quantize(v, scale[1]).flatten(), v.float().flatten(),
                f"write_kv {dtype} V")


if __name__ == "__main__":
    main()
