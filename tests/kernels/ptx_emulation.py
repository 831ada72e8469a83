"""The PTX of kernels/triton/w4_gemv_h2.py's ``tl.inline_asm_elementwise`` blocks, emulated in numpy for Triton's
CPU interpreter (which runs no inline assembly): the kernel's indexing, halves, act-order gathers and split K then
run on the host, with each instruction computed as the PTX ISA defines it. Only the instructions those blocks use
are known; any other fails the test that meets it.
"""

import contextlib
import re

import numpy as np
import pytest
import triton
from triton.runtime import interpreter


def _halves(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """b32 -> its (low, high) fp16 halves."""
    return (v & 0xFFFF).astype(np.uint16).view(np.float16), (v >> 16).astype(np.uint16).view(np.float16)


def _half2(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Two float arrays rounded to fp16 (once: from float64 or float32) -> b32, ``lo`` the low half."""
    bits = [h.astype(np.float16).view(np.uint16).astype(np.uint32) for h in (lo, hi)]
    return bits[0] | bits[1] << 16


def _lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, lut: int) -> np.ndarray:
    """Bit i of the result: bit (a_i << 2 | b_i << 1 | c_i) of ``lut``."""
    out = np.zeros_like(a)
    for k in range(8):
        if lut >> k & 1:
            out |= (a if k & 4 else ~a) & (b if k & 2 else ~b) & (c if k & 1 else ~c)
    return out


def run(asm: str, inputs: list[np.ndarray]) -> np.ndarray:
    """The block over elementwise operands ($1.. ``inputs``, 32-bit, broadcast) -> $0's 32 bits (uint32)."""
    shape = np.broadcast_shapes(*(v.shape for v in inputs))
    regs = {f"${i + 1}": np.broadcast_to(v.view(np.uint32), shape) for i, v in enumerate(inputs)}

    def val(tok: str) -> np.ndarray:
        return regs[tok] if tok in regs else np.full(shape, int(tok, 0), dtype=np.uint32)

    for statement in asm.split(";"):
        statement = statement.strip().strip("{}").strip()
        if not statement or statement.startswith(".reg"):
            continue
        op, rest = statement.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):  # unpack: mov.b32 {lo, hi}, src
            lo, hi, src = re.findall(r"[\w$]+", rest)
            regs[lo], regs[hi] = val(src) & 0xFFFF, val(src) >> 16
            continue
        d, *args = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            regs[d] = val(args[0])
        elif op == "shr.b32":
            regs[d] = val(args[0]) >> int(args[1], 0)
        elif op == "lop3.b32":
            regs[d] = _lop3(*(val(a) for a in args[:3]), int(args[3], 0))
        elif op in ("sub.rn.f16x2", "mul.rn.f16x2", "fma.rn.f16x2"):  # per lane, one rounding to fp16
            halves = [_halves(val(a)) for a in args]
            math = {"sub": lambda a, b: a - b, "mul": lambda a, b: a * b, "fma": lambda a, b, c: a * b + c}[op[:3]]
            regs[d] = _half2(*(math(*(h[lane].astype(np.float64) for h in halves)) for lane in (0, 1)))
        elif op == "cvt.f32.f16":
            regs[d] = (val(args[0]) & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
        elif op == "add.f32":
            regs[d] = (val(args[0]).view(np.float32) + val(args[1]).view(np.float32)).view(np.uint32)
        elif op == "cvt.rn.f16x2.f32":  # d's high half from the first source, its low half from the second
            regs[d] = _half2(val(args[1]).view(np.float32), val(args[0]).view(np.float32))
        else:
            raise ValueError(f"no emulation of {op}: the emulator knows only the instructions the kernel uses")
    return np.ascontiguousarray(regs["$0"], dtype=np.uint32)


class _Results:
    def __init__(self, handles: list):
        self.handles = handles

    def get_result(self, i: int):
        return self.handles[i]


def _create_inline_asm(self, asm, constraints, values, types, is_pure, pack):
    if pack != 1 or len(types) != 1:
        raise ValueError("the emulator takes one 32-bit result an element")
    dtype = types[0].scalar if hasattr(types[0], "scalar") else types[0]
    bits = run(asm, [np.ascontiguousarray(v.data) for v in values])
    return _Results([interpreter.TensorHandle(bits.view(np.float32 if dtype.is_fp32() else np.int32), dtype)])


@contextlib.contextmanager
def emulated_ptx():
    """Triton's interpreter running inline PTX through ``run`` while inside."""
    if not hasattr(interpreter.InterpreterBuilder, "create_inline_asm"):  # this emulation hooks that method
        pytest.skip(f"triton {triton.__version__}'s interpreter has no create_inline_asm to emulate PTX through")
    before = interpreter.InterpreterBuilder.create_inline_asm
    interpreter.InterpreterBuilder.create_inline_asm = _create_inline_asm
    try:
        yield
    finally:
        interpreter.InterpreterBuilder.create_inline_asm = before
