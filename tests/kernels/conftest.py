"""Without CUDA, Triton kernels can only run through Triton's CPU interpreter, and Triton reads
TRITON_INTERPRET when ``triton.language`` is first imported (its standard-library functions are
decorated then), so it is set here, before any test module of this folder imports triton.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
