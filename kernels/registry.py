"""Which implementation each kernel op runs: the Triton kernel registered for it on CUDA, its CPU kernel
on the CPU when there is one (kernels/cpu_attention.py), and the plain-torch reference (kernels/reference.py)
everywhere else. Triton modules register here, not through the package root, so the root can install them
without the two importing each other."""

import os
from collections.abc import Callable

import torch

from kvrelay.kernels import cpu_attention, reference

_cuda_impls: dict[str, Callable] = {}
# KVRELAY_KERNELS=reference runs the references on the CPU too (the baseline the CPU kernels are timed against)
_cpu_impls: dict[str, Callable] = (
    {} if os.environ.get("KVRELAY_KERNELS", "triton") == "reference"
    else {"paged_attention": cpu_attention.paged_attention})


def register(name: str, fn: Callable) -> None:
    _cuda_impls[name] = fn


def fused(name: str, x: torch.Tensor) -> Callable | None:
    """The kernel registered for a composite op (one that is, by definition, other ops in turn), or None."""
    return _cuda_impls.get(name) if x.is_cuda else None


def implementation(name: str, x: torch.Tensor) -> Callable:
    if x.is_cuda and name in _cuda_impls:
        return _cuda_impls[name]
    if x.device.type == "cpu" and name in _cpu_impls:
        return _cpu_impls[name]
    return getattr(reference, name)
