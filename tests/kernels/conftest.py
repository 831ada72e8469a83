"""Without CUDA, Triton kernels can only run through Triton's CPU interpreter, and Triton reads
TRITON_INTERPRET when ``triton.language`` is first imported (its standard-library functions are
decorated then), so it is set here, before any test module of this folder imports triton.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture()
def unzeroed_empty(monkeypatch):
    """torch.empty's floating-point tensors come filled with NaN: a kernel that leaves any element of its
    scratch or output unwritten puts a NaN in the result."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
