"""Quantized linear layers: each holds its weight in a kernel layout (kernels/quant.py), routes the
checkpoint's tensors into it (converting published layouts, or quantizing full-precision weights as they
arrive), and runs its matmul through ``kernels`` (on CUDA the weight-only ones take their fused kernels for a
few rows and, from kernels/triton/dequant_linear.py's ``DEQUANT_MIN_ROWS`` rows, the weight dequantized whole
and cuBLAS; fp8 its tensor-core path).

Fused projections (q|k|v, gate|up) load part by part as the plain layers do: every parameter records
which of its dimensions is the output one (``output_dim``), so a part's rows land in the right slice of
packed or per-channel tensors alike. Per-channel and per-group quantization treat each output row on
its own, so quantizing one part at a time gives exactly what quantizing the fused weight would.

Under tensor parallelism (int8, fp8) a rank's cut of the outputs (column-parallel: its heads, its rows)
comes before quantizing, with its scales cut the same way, and a cut of the inputs (row-parallel) comes
after: each output channel's scale is the whole row's, as on one rank, so the shards' partial sums add
up to exactly the unsplit layer's. AWQ and GPTQ tensors are cut after unpacking to the W4 layout, their
scales and zero points with them.
"""

from collections.abc import Callable

import torch
from torch import nn

from kvrelay import kernels
from kvrelay.kernels.quant import dequantize_w4, quantize_channel
from kvrelay.kernels.w4_repack import (
    W4Packed,
    act_order_perm,
    dequantize_packed,
    interleave_w4,
    sort_and_interleave,
    tile_k_for,
)
from kvrelay.shared.engine.dummy_weights import fill_bits_, fill_normal_
from kvrelay.shared.engine.quant import formats
from kvrelay.shared.engine.quant.config import W4_METHODS, QuantConfig

Convert = Callable[[torch.Tensor], torch.Tensor] | None
QuantRoute = tuple[nn.Parameter, slice | None, Convert]
DUMMY_STD = 0.02  # as shared/engine/loader.py's dummy weights


def _param(t: torch.Tensor, output_dim: int | None) -> nn.Parameter:
    p = nn.Parameter(t, requires_grad=False)
    p.output_dim = output_dim  # type: ignore[attr-defined]  # read by CausalLM._load_tensors
    return p


def _then(first: Convert, second: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    return second if first is None else (lambda t: second(first(t)))


class QuantLinear(nn.Module):
    """Base: ``in_features`` -> ``out_features``, with an optional bias in the model dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, quant: QuantConfig):
        super().__init__()
        self.in_features, self.out_features, self.quant = in_features, out_features, quant
        self.bias = _param(torch.empty(out_features, dtype=dtype), 0) if bias else None

    def checkpoint_suffixes(self) -> list[str]:
        raise NotImplementedError

    def route(self, suffix: str, rows: slice | None, pre: Convert = None, inputs: Convert = None) -> QuantRoute | None:
        """Where the checkpoint tensor ``<layer>.<suffix>`` goes (``rows``: this part's output rows of a
        fused layer; ``pre``: the model's own conversion of the tensor, applied first, which may cut this
        rank's output rows; ``inputs``: a row-parallel rank's cut of the weight's input columns)."""
        if suffix == "bias" and self.bias is not None:
            return self.bias, rows, pre
        return None

    def init_dummy(self, seed: int, prefix: str) -> None:
        """Dummy weights for the layer named ``prefix``, from shared/engine/dummy_weights.py's streams."""
        raise NotImplementedError

    def norm_forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(rms_norm(x [+ residual])), the residual stream); a format may fuse the norm into its matmul."""
        if residual is None:
            return self(kernels.rms_norm(x, norm_weight, eps)), x
        normed, residual = kernels.rms_norm(x, norm_weight, eps, residual)
        return self(normed), residual

    def silu_forward(self, x: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) of x = gate | up; a format may fuse the product into its matmul."""
        return self(kernels.silu_mul(x))


class ChannelLinear(QuantLinear):
    """int8 (W8A16) or fp8 (e4m3) weight [N, K] with one fp32 scale per output channel."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, quant: QuantConfig):
        super().__init__(in_features, out_features, bias, dtype, quant)
        wtype = torch.int8 if quant.method == "int8" else torch.float8_e4m3fn
        self.weight = _param(torch.empty(out_features, in_features, dtype=wtype), 0)
        self.weight_scale = _param(torch.ones(out_features, dtype=torch.float32), 0)

    def checkpoint_suffixes(self) -> list[str]:
        return ["weight"] + (["weight_scale"] if self.quant.prequantized else []) + \
            (["bias"] if self.bias is not None else [])

    def route(self, suffix: str, rows: slice | None, pre: Convert = None, inputs: Convert = None) -> QuantRoute | None:
        part = self.weight_scale.data if rows is None else self.weight_scale.data[rows]
        if suffix == "weight" and not self.quant.prequantized:
            def quantize(t: torch.Tensor) -> torch.Tensor:
                q, scale = quantize_channel(t, self.quant.method)  # over whole rows: before any input cut
                part.copy_(scale)  # this part's scales; its rows of the weight are the loader's to copy
                return q
            quantized = _then(pre, quantize)
            return self.weight, rows, quantized if inputs is None else _then(quantized, inputs)
        if suffix == "weight":
            return self.weight, rows, pre if inputs is None else _then(pre, inputs)
        if suffix == "weight_scale" and self.quant.prequantized:
            def scales(t: torch.Tensor) -> torch.Tensor:
                # a per-tensor scale ([] or [1]) covers every row of its part; a per-channel one ([N] or
                # [N, 1]) is cut to this rank's rows as the weight is (an input cut leaves it whole)
                flat = t.float().reshape(-1)
                if flat.numel() == 1:
                    return flat.expand(part.shape[0])
                return flat if pre is None else pre(flat)
            return self.weight_scale, rows, scales
        return super().route(suffix, rows, pre)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = kernels.int8_linear if self.quant.method == "int8" else kernels.fp8_linear
        return op(x, self.weight, self.weight_scale, self.bias)

    def norm_forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if self.quant.method == "int8":  # W8A16: the activations stay in the model's dtype, nothing to fuse
            return super().norm_forward(x, residual, norm_weight, eps)
        return kernels.rms_norm_fp8_linear(x, residual, norm_weight, eps, self.weight, self.weight_scale, self.bias)

    def silu_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant.method == "int8":
            return super().silu_forward(x)
        return kernels.silu_mul_fp8_linear(x, self.weight, self.weight_scale, self.bias)

    @torch.no_grad()
    def init_dummy(self, seed: int, prefix: str) -> None:
        # the unquantized model's stream for this weight: the quantized dummy model approximates that one
        w = torch.empty(self.weight.shape, dtype=torch.bfloat16, device=self.weight.device)
        q, scale = quantize_channel(fill_normal_(w, seed, f"{prefix}.weight", DUMMY_STD), self.quant.method)
        self.weight.copy_(q)
        self.weight_scale.copy_(scale)


class W4Linear(QuantLinear):
    """AWQ or GPTQ 4-bit weight, converted at load into kernels/quant.py's W4 layout, and its nibbles
    interleaved (``tile_k``: kernels/w4_repack.py) for kernels/triton/w4_fast.py: as it arrives, or with
    GPTQ's act-order in ``finish_loading``, once g_idx (which may arrive after the rows) has sorted the
    rows into whole groups (``perm``). Group sizes with no K tile of 16 or more, and a g_idx that is not
    whole groups, keep the plain layout and kernels/triton/w4a16.py (``tile_k`` None)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, quant: QuantConfig):
        super().__init__(in_features, out_features, bias, dtype, quant)
        k, n, g = in_features, out_features, quant.group_size
        if k % g or k % 8 or n % 8:
            raise ValueError(f"{quant.method} group size {g} does not fit a {k} -> {n} projection (the group size "
                             "must divide the input size, and both sizes must be multiples of 8)")
        self.qweight = _param(torch.empty(k // 8, n, dtype=torch.int32), 1)
        self.qzeros = _param(torch.empty(k // g, n, dtype=torch.uint8), 1)
        self.scales = _param(torch.empty(k // g, n, dtype=torch.float16), 1)
        self.g_idx = _param(torch.empty(k, dtype=torch.int32), None) if quant.method == "gptq" else None
        self.tile_k = None if quant.desc_act else tile_k_for(g, k)  # act-order: set by finish_loading
        self.register_buffer("perm", None, persistent=False)  # not in a weight arena: each process derives it

    def checkpoint_suffixes(self) -> list[str]:
        names = ["qweight", "qzeros", "scales"] + (["g_idx"] if self.quant.desc_act else [])
        return names + (["bias"] if self.bias is not None else [])

    def route(self, suffix: str, rows: slice | None, pre: Convert = None, inputs: Convert = None) -> QuantRoute | None:
        awq = self.quant.method == "awq"
        minus_one = self.quant.zeros_minus_one
        to_w4 = {"qweight": formats.awq_qweight_to_w4 if awq else None,
                 "qzeros": formats.awq_qzeros_to_w4 if awq else (lambda t: formats.gptq_qzeros_to_w4(t, minus_one)),
                 "scales": None}
        if suffix in to_w4:
            # a rank's cuts come after unpacking: in the W4 layout every tensor is [inputs (in words of 8
            # or in groups), outputs], so an output cut is clean at any width, and an input cut lands on word
            # and group boundaries because this shard's own input size is a multiple of both (__init__)
            interleave = (lambda t: interleave_w4(t, self.tile_k)) if suffix == "qweight" and self.tile_k else None
            return getattr(self, suffix), rows, _then_all(to_w4[suffix], _transposed(pre), _transposed(inputs),
                                                          interleave)
        if suffix == "g_idx" and self.g_idx is not None:
            # one per input, shared by the parts of a fused layer (they see the same inputs, so GPTQ's
            # act-order gives them the same order); a row-parallel rank keeps its inputs' (read only with
            # act-order, which tensor parallelism refuses: shared/engine/loader.py)
            return self.g_idx, None, None if inputs is None else (lambda t: inputs(t[None])[0])
        return super().route(suffix, rows, pre)

    @torch.no_grad()
    def finish_loading(self, mapped: bool) -> None:
        """Act-order: sort the rows by g_idx into whole groups and interleave them, in place, keeping the
        order as ``perm``. ``mapped``: the parameters are a shared arena another process filled, and this
        step already rewrote them there (they must hold the same bytes in every process, and a second
        sort would scramble them), so only ``perm`` is derived, from the shared g_idx: a stable sort of
        the same g_idx gives the same order in every process."""
        tile_k = tile_k_for(self.quant.group_size, self.in_features)
        if not self.quant.desc_act or self.tile_k is not None or tile_k is None:
            return  # not act-order, done already, or no K tile: the plain layout stays
        try:
            perm = act_order_perm(self.g_idx, self.quant.group_size)
        except ValueError:  # g_idx scatters a group: the plain layout's kernel reads it as it is
            return
        if not mapped:  # sorted, row i is in group i // G: the zero points and scales stay where they are
            self.qweight.copy_(sort_and_interleave(self.qweight, perm, tile_k))
        self.perm, self.tile_k = perm, tile_k

    def packed(self) -> W4Packed | None:
        if self.tile_k is None:
            return None
        return W4Packed(self.qweight, self.scales, self.qzeros, self.perm, self.quant.group_size, self.tile_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed()
        if packed is not None:
            return kernels.w4_packed_linear(x, packed, self.bias)
        g_idx = self.g_idx if self.quant.desc_act else None
        return kernels.w4a16_linear(x, self.qweight, self.qzeros, self.scales, self.quant.group_size, g_idx, self.bias)

    def dequantize(self) -> torch.Tensor:
        """The [N, K] weight in fp32, whichever layout this layer holds."""
        packed = self.packed()
        if packed is not None:
            return dequantize_packed(packed)
        return dequantize_w4(self.qweight, self.qzeros, self.scales, self.quant.group_size,
                             self.g_idx if self.quant.desc_act else None)

    @torch.no_grad()
    def init_dummy(self, seed: int, prefix: str) -> None:
        # uniform 4-bit values around zero point 8 have std ~4.6: scaled to the dense dummy's 0.02
        fill_bits_(self.qweight, seed, f"{prefix}.qweight")  # all 32 bits: every nibble uniform
        self.qzeros.fill_(8)
        self.scales.fill_(DUMMY_STD / 4.6)
        if self.g_idx is not None:
            self.g_idx.copy_(torch.arange(self.in_features, device=self.g_idx.device) // self.quant.group_size)


def _transposed(cut: Convert) -> Convert:
    """A cut written for a [outputs, inputs] tensor, applied to a W4 one laid out [inputs, outputs]."""
    return None if cut is None else (lambda t: cut(t.t()).t())


def _then_all(*steps: Convert) -> Convert:
    done: Convert = None
    for step in steps:
        if step is not None:
            done = step if done is None else _then(done, step)
    return done


def make_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                quant: QuantConfig | None, plain: type[nn.Linear]) -> nn.Module:
    """``plain(in, out)`` without quantization, else the quantized layer for ``quant.method``."""
    if quant is None:
        return plain(in_features, out_features, bias=bias, dtype=dtype)
    cls = W4Linear if quant.method in W4_METHODS else ChannelLinear
    return cls(in_features, out_features, bias, dtype, quant)
