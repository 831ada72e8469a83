"""What a test module of Triton kernels through Triton's CPU interpreter calls before it imports them."""

import os
import sys

import pytest
import torch


def interpret_triton_kernels(gpu_tests: str) -> None:
    """Skips the calling module where the interpreter cannot be had (on a CUDA machine, ``gpu_tests`` covers
    the kernels unless TRITON_INTERPRET=1 is already set), and drops a copy of kvrelay.kernels.triton built
    without it, so that the module's own import builds the kernels interpreted."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(f"CUDA present: {gpu_tests} covers these kernels", allow_module_level=True)
    # Triton decides interpreted-or-compiled when a function is decorated: its own standard library
    # (tl.zeros, tl.max, ...) at the first `import triton`, our kernels when kernels.triton is imported.
    # conftest.py sets the flag before the first.
    os.environ["TRITON_INTERPRET"] = "1"
    triton = pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(triton.language.standard.zeros, InterpretedFunction):
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; run with it in the environment: "
                    "TRITON_INTERPRET=1 python -m pytest tests/kernels", allow_module_level=True)
    for name in [m for m in sys.modules if m == "kvrelay.kernels.triton" or m.startswith("kvrelay.kernels.triton.")]:
        del sys.modules[name]
