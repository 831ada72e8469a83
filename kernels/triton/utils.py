"""Launch helpers shared by the Triton kernels: interpreter detection, block sizing, SM count."""

import functools
import os

import torch
import triton


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
