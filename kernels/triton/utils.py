"""Launch helpers shared by the Triton kernels: interpreter detection, block sizing, SM count."""

import functools
import os

import torch
import triton
import triton.language as tl

# Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the kernel
# before it drains, do what does not depend on that kernel (pull its weights towards L2), and only then
# wait (gdc_wait) for that kernel's writes. A batch-1 decode step is ~230 short kernels, each otherwise
# paying its ramp in full. Every PDL kernel waits before it reads or writes anything a kernel of the step
# writes, so completion stays transitive along the stream. False: plain launches (bench/fused_probe.py).
PDL = True
PREFETCH = True  # the skinny projections pull their weight rows into L2 before they wait


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``).

    Read at call time, not import time: the interpreter's ``tl.dot`` multiplies bfloat16 tiles as
    their raw uint16 bit patterns (triton 3.9), so the attention kernels upcast dot operands to fp32
    there via a constexpr flag, and that flag has to follow the mode the kernels were built in.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(max(1, int(n))))


@functools.cache
def _capability(index: int) -> int:
    return torch.cuda.get_device_properties(index).major


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with programmatic dependent launch (``launch_pdl``)."""
    if not PDL or device.type != "cuda" or interpreting():
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@triton.jit
def pdl_start(PDL: tl.constexpr):
    # let the next kernel launch now (it waits for this one before touching its outputs)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    # wait for the kernel before this one to finish and its writes to be visible
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    # start pulling the lines at ``ptrs`` into L2 without waiting for them (one address per 128-byte line)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs.to(tl.uint64, bitcast=True)],
                              dtype=tl.int32, is_pure=False, pack=1)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessor count (cached, so launchers stay cheap and CUDA-graph capturable); 1 on CPU."""
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [R, N] with unit stride in the last dim, copying only when a view is impossible."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def row_warps(block: int) -> int:
    # one program per row: ~8 elements per thread keeps 16-byte accesses and few registers
    return min(16, max(1, block // 256))
