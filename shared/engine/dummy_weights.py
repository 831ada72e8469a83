"""Dummy weights as a pure function of (seed, parameter name, element index): the same values on any
device, at any SM count, in any chunking.

torch's own random kernels size their launch grid from the device (its SM count, which CUDA MPS shrinks),
and each thread's share of the Philox stream follows the grid: one seed gives other numbers on another
share of a GPU, and others again on the CPU. Here every element is a splitmix64 hash of its own counter,
computed with elementwise int64 ops and exact float steps only (small integers to float32, one multiply
by a float32 constant), so the bits are the same wherever and however the elements are computed.

A draw is approximately normal: the sum of four independent uniform 16-bit fields of one hash
(Irwin-Hall), centred and scaled to the asked std. It is bell-shaped but bounded at about 3.46 std;
transcendental Box-Muller would be closer to normal but its log and cos are not bit-identical across
CPU and CUDA libraries.
"""

import hashlib
from collections.abc import Callable

import torch

# elements per pass, a few int64 temporaries of this size whatever the parameter's size: on the CPU small enough
# that they stay in its L2 cache (a pass over main memory per int64 op is what made large chunks slow); on a GPU
# large, so a 8B model's fill is a few hundred launches
CPU_CHUNK, DEVICE_CHUNK = 1 << 16, 1 << 24

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_FIELD = 1 << 16
_FIELD_STD = ((_FIELD * _FIELD - 1) / 12 * 4) ** 0.5  # the std of a sum of four uniform 16-bit fields


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 torch holds it."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def _mix_int(x: int) -> int:
    """splitmix64's finalizer on a Python int (the key of a stream)."""
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    # torch shifts int64 arithmetically: the sign bits it copies in are masked off for a logical shift
    return (x >> bits).bitwise_and_((1 << (64 - bits)) - 1)


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer elementwise, in place, on int64 (multiplication wraps mod 2**64 on CPU and
    CUDA)."""
    x.bitwise_xor_(_shr(x, 30)).mul_(_signed(_MIX1))
    x.bitwise_xor_(_shr(x, 27)).mul_(_signed(_MIX2))
    return x.bitwise_xor_(_shr(x, 31))


def stream_key(seed: int, name: str) -> int:
    """The stream of parameter ``name``: by name, so two parameters of one shape differ, and a pipeline
    stage's layers (which keep the whole model's names) hold the whole model's values."""
    name_hash = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return _mix_int(_mix_int(seed & _MASK64) ^ name_hash)


def _hashes(key: int, start: int, end: int, device: torch.device) -> torch.Tensor:
    """The 64-bit hashes of elements ``start`` to ``end`` of stream ``key``, as int64."""
    index = torch.arange(start, end, dtype=torch.int64, device=device)
    return _mix_(index.mul_(_signed(_GOLDEN)).add_(_signed(key)))


def _bell(h: torch.Tensor, std: float) -> torch.Tensor:
    """float32 ~N(0, std) (Irwin-Hall of four 16-bit fields): integers below 2**18 convert exactly, and a
    single multiply by a float32 constant rounds the same on every device."""
    total = _shr(h, 48).add_(h & (_FIELD - 1))
    for shift in (16, 32):
        total += _shr(h, shift).bitwise_and_(_FIELD - 1)
    centred = total.mul_(2).sub_(4 * (_FIELD - 1)).to(torch.float32)  # twice the offset from the mean
    # rounded to float32 first: a float32 product of two float32s is the same whether a device computes it
    # in float32 or in double and rounds
    scale = torch.tensor(std / _FIELD_STD / 2, dtype=torch.float32).item()
    return centred.mul_(scale)


def _fill(out: torch.Tensor, seed: int, name: str, values: Callable[[torch.Tensor], torch.Tensor],
          chunk: int | None) -> torch.Tensor:
    if not out.is_contiguous():
        raise ValueError(f"dummy weight {name} is not contiguous")
    key, flat = stream_key(seed, name), out.view(-1)
    chunk = chunk or (CPU_CHUNK if out.device.type == "cpu" else DEVICE_CHUNK)
    for start in range(0, flat.numel(), chunk):
        end = min(start + chunk, flat.numel())
        flat[start:end].copy_(values(_hashes(key, start, end, out.device)))
    return out


@torch.no_grad()
def fill_normal_(out: torch.Tensor, seed: int, name: str, std: float, chunk: int | None = None) -> torch.Tensor:
    """``out`` filled in place with ~N(0, std) values of stream (seed, name), computed in float32 and cast
    to ``out``'s dtype."""
    return _fill(out, seed, name, lambda h: _bell(h, std), chunk)


@torch.no_grad()
def fill_bits_(out: torch.Tensor, seed: int, name: str, chunk: int | None = None) -> torch.Tensor:
    """``out`` (int32) filled in place with uniform 32-bit patterns of stream (seed, name)."""
    if out.dtype != torch.int32:
        raise ValueError(f"fill_bits_ fills int32, not {out.dtype}")
    return _fill(out, seed, name, lambda h: ((h & 0xFFFFFFFF) ^ (1 << 31)) - (1 << 31), chunk)
