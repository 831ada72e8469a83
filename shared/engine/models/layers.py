"""Building blocks shared by the model files: uninitialised Linear/Embedding, norms that call
kernels/, config lookups, and the checkpoint-loading base class every model inherits.

Weights always come from a checkpoint or the dummy initialiser, so layers skip PyTorch's default
init: it would cost seconds on CPU for a real model and would touch memory twice on GPU.
"""

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay import kernels
from kvrelay.shared.engine.kv_dtype import KV_SCALE_NAME
from kvrelay.shared.engine.parallel import linear as tp
from kvrelay.shared.engine.parallel.embedding import VocabParallelEmbedding, parallel_logits, vocab_range, vocab_rows
from kvrelay.shared.engine.parallel.pipeline import WHOLE, PipelineStage, held, prune
from kvrelay.shared.engine.parallel.state import SINGLE, ParallelState
from kvrelay.shared.engine.quant.config import QuantConfig
from kvrelay.shared.engine.quant.linear import QuantLinear, make_linear
from kvrelay.shared.engine.weight_upload import WeightUploader

_MISSING = object()

# where one checkpoint tensor lands: the parameter, which rows of it (fused projections), and a
# conversion applied first (GPT-2's transposed Conv1D, BLOOM's interleaved qkv)
Route = tuple[nn.Parameter, slice | None, Callable[[torch.Tensor], torch.Tensor] | None]


def cfg_get(cfg: dict, *keys: str, default: Any = _MISSING) -> Any:
    """First key present (and not None) in an HF config dict; configs spell one thing several ways."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    if default is _MISSING:
        raise ValueError(f"model config lacks {' / '.join(keys)}")
    return default


class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        pass  # filled by load_weights or the dummy initialiser


def quant_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 quant: QuantConfig | None) -> nn.Module:
    """A decoder projection: ``Linear`` unless the model is quantized (shared/engine/quant/linear.py)."""
    return make_linear(in_features, out_features, bias, dtype, quant, Linear)


def on_the_fly_only(quant: QuantConfig | None, model: str) -> None:
    """Models whose projections quantize as they load (int8, fp8) but have no 4-bit or FP8 checkpoints."""
    if quant is not None and (quant.prequantized or quant.method not in ("int8", "fp8")):
        raise ValueError(f"{model} supports quantization int8 and fp8 of full-precision checkpoints only; "
                         f"got {quant.method}{' (a pre-quantized checkpoint)' if quant.prequantized else ''}")


def split_cut(cut: Callable[[torch.Tensor], torch.Tensor] | None) -> tuple[Callable | None, Callable | None]:
    """A rank's cut of a projection's tensor as (before quantizing, after quantizing): a row-parallel cut of
    the inputs goes after, so each output channel's scale is taken over its whole row as on one rank
    (shared/engine/quant/linear.py); any other cut (outputs, a bias) goes before."""
    if isinstance(cut, partial) and cut.func is tp.row:
        return None, cut
    return cut, None


def submodule_route(model: nn.Module, name: str, convert: Callable[[torch.Tensor], torch.Tensor] | None,
                    inputs: Callable[[torch.Tensor], torch.Tensor] | None = None) -> "Route | None":
    """``linear_route`` for the projection a full tensor name ends in."""
    path, _, suffix = name.rpartition(".")
    try:
        return linear_route(model.get_submodule(path), suffix, None, convert, inputs)
    except AttributeError:
        return None


def project(x: torch.Tensor, proj: nn.Module) -> torch.Tensor:
    """proj(x); a plain projection takes the one-row kernel on GPU (kernels/triton/skinny_linear.py)."""
    if isinstance(proj, QuantLinear):
        return proj(x)
    return kernels.linear(x, proj.weight, proj.bias)


def norm_project(x: torch.Tensor, residual: torch.Tensor | None, norm: "RMSNorm",
                 proj: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(proj(rms_norm(x [+ residual])), the residual stream): fused for a plain projection; a quantized one
    as its format fuses it."""
    if isinstance(proj, QuantLinear):
        return proj.norm_forward(x, residual, norm.weight, norm.eps)
    return kernels.rms_norm_linear(x, residual, norm.weight, norm.eps, proj.weight, proj.bias)


def silu_project(x: torch.Tensor, proj: nn.Module) -> torch.Tensor:
    """proj(silu(gate) * up) of x = gate | up."""
    if isinstance(proj, QuantLinear):
        return proj.silu_forward(x)
    return kernels.silu_mul_linear(x, proj.weight, proj.bias)


def linear_route(module: nn.Module, suffix: str, rows: slice | None,
                 convert: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 inputs: Callable[[torch.Tensor], torch.Tensor] | None = None) -> "Route | None":
    """Where checkpoint tensor ``<module>.<suffix>`` (``rows`` of a fused projection) goes; ``inputs``: a
    row-parallel rank's cut of the weight's inputs, after ``convert`` (and after quantizing)."""
    if isinstance(module, QuantLinear):
        return module.route(suffix, rows, convert, inputs)
    param = getattr(module, suffix, None) if suffix in ("weight", "bias") else None
    if param is None:
        return None
    if inputs is not None:
        convert = inputs if convert is None else (lambda t, first=convert: inputs(first(t)))
    return param, rows, convert


def linear_names(prefix: str, module: nn.Module) -> list[str]:
    """The checkpoint tensors of one projection: weight (+ bias), or its quantized format's tensors."""
    if isinstance(module, QuantLinear):
        return [f"{prefix}.{suffix}" for suffix in module.checkpoint_suffixes()]
    return [prefix + ".weight"] + ([prefix + ".bias"] if module.bias is not None else [])


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


def vocab_embedding(vocab: int, hidden: int, dtype: torch.dtype, parallel: ParallelState) -> nn.Module:
    """The token embedding: whole, or this rank's rows of it (shared/engine/parallel/embedding.py)."""
    if parallel.world_size == 1:
        return Embedding(vocab, hidden, dtype=dtype)
    return VocabParallelEmbedding(vocab, hidden, dtype, parallel)


def lm_head(hidden: int, vocab: int, dtype: torch.dtype, parallel: ParallelState) -> Linear:
    """An untied LM head: whole, or this rank's (padded) rows of the vocabulary."""
    rows = vocab_range(vocab, parallel.rank, parallel.world_size)[2]
    return Linear(hidden, rows, bias=False, dtype=dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # with a residual: the fused add+norm form, returns (normed, x + residual)
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.layer_norm(x, self.weight, self.bias, self.eps)


class CausalLM(nn.Module, ABC):
    """Base of every model: the engine-facing attributes plus HF-name weight loading.

    Subclasses name their modules like HF does wherever the layout is the same, so most tensors
    route by name; they override ``route`` only for fused or converted tensors.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    # False for ALiBi models: they extrapolate past their training length instead of running out
    # of position embeddings, so a longer max_model_len is the user's call, not an error
    has_position_limit: bool = True
    # checkpoint tensors that are buffers, not weights (causal masks, rotary inv_freq)
    ignored_names: re.Pattern[str] = re.compile(r"$^")
    # the decoder projections' quantization (shared/engine/quant/); None: full precision
    quant: QuantConfig | None = None
    # static activation scales of FP8 checkpoints: activations are scaled per token instead (their KV
    # scales are not weights either: the KV cache reads them, shared/engine/kv_dtype.py)
    _quant_ignored = re.compile(r"\.(input_scale|output_scale)$")
    # this model's tensor-parallel group; num_heads and num_kv_heads count the heads of this rank
    parallel: ParallelState = SINGLE
    # checkpoint tensors split by vocabulary rows across the group (embedding, untied LM head)
    vocab_tensors: tuple[str, ...] = ()
    # pipeline parallelism (shared/engine/parallel/pipeline.py): the layers this model holds, the
    # modules only the first or the last stage holds (the token embedding is kept by the last stage too
    # when the LM head is tied to it), and how many [T, hidden] tensors one stage hands the next
    stage: PipelineStage = WHOLE
    embedding_module: str = ""
    first_stage_modules: tuple[str, ...] = ()
    last_stage_modules: tuple[str, ...] = ()
    carried_tensors: int = 1
    hidden_size: int

    def prune_to_stage(self, stage: PipelineStage) -> None:
        """Drop the modules another stage holds (the layers were built as placeholders already)."""
        self.stage = stage
        if stage.size == 1:
            return
        first = self.first_stage_modules
        if not self.tie_word_embeddings:
            first += (self.embedding_module,)
        elif not (stage.first or stage.last):
            first += (self.embedding_module,)
        prune(self, stage, first, self.last_stage_modules)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype its activations are in: its norms' and biases', not a quantized projection's weight or
        scales (whose parameters come first on a later pipeline stage, holding no embedding)."""
        quantized = {id(p) for m in self.modules() if isinstance(m, QuantLinear)
                     for name, p in m.named_parameters() if name != "bias"}
        return next(p.dtype for p in self.parameters() if id(p) not in quantized)

    def held_layers(self) -> list[tuple[int, nn.Module]]:
        """(index, layer) of the decoder layers this stage holds, in order."""
        layers = self.decoder_layers()
        return [(i, layers[i]) for i in self.stage.layers(len(layers))]

    @property
    def kv_layers(self) -> int:
        """The layers this stage's KV cache holds."""
        return len(self.stage.layers(self.num_layers))

    @abstractmethod
    def checkpoint_names(self) -> list[str]:
        """Every tensor name (after ``normalize_name``) a complete checkpoint provides."""

    @abstractmethod
    def decoder_layers(self) -> nn.ModuleList:
        """The decoder blocks in order; each writes its layer's KV during its forward."""

    @abstractmethod
    def output_embedding(self) -> torch.Tensor:
        """The [vocab, hidden] matrix the logits are computed against (the embedding when tied)."""

    def normalize_name(self, name: str) -> str:
        return name

    def route(self, name: str) -> Route | None:
        if self.quant is not None:
            path, _, suffix = name.rpartition(".")
            try:
                module = self.get_submodule(path) if path else None
            except AttributeError:
                module = None
            if isinstance(module, QuantLinear):  # this rank's cut of it, around the quantization
                return module.route(suffix, None, *split_cut(self.shard(name)))
        param = dict(self.named_parameters()).get(name)
        return None if param is None else (param, None, self.shard(name))

    def shard(self, name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """How this rank cuts its part from the full checkpoint tensor ``name`` (None: it keeps all of it).
        Models add their row-parallel tensors; fused ones are cut in their own ``route``."""
        p = self.parallel
        if p.world_size > 1 and name in self.vocab_tensors:
            return lambda t: vocab_rows(t, self.vocab_size, p.rank, p.world_size)
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden] -> [S, vocab]; the matmul stays in model dtype, sampling wants fp32
        if self.parallel.world_size > 1:  # every rank of the group takes part; rank 0 samples
            return parallel_logits(hidden, self.output_embedding(), self.parallel, self.vocab_size)
        return F.linear(hidden, self.output_embedding()).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        expected = {name for name in self.checkpoint_names() if held(self, name)}
        seen: set[str] = set()
        upload = WeightUploader(next(self.parameters()).device)
        try:
            self._load_tensors(weights, seen, upload)
        finally:
            upload.finish()
        missing = sorted(expected - seen)
        if missing:
            shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing tensor(s) for {type(self).__name__}: {shown}")

    def _load_tensors(self, weights: Iterable[tuple[str, torch.Tensor]], seen: set[str],
                      upload: WeightUploader) -> None:
        for original, tensor in weights:
            name = self.normalize_name(original)
            if self.ignored_names.search(name) or (self.quant is not None and self._quant_ignored.search(name)):
                continue
            if KV_SCALE_NAME.search(name):
                continue  # the KV cache's, read by shared/engine/kv_scales.py
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # tied: the embedding is the one source of truth, as in HF's tie_weights
            if not held(self, name):
                continue  # another pipeline stage's
            target = self.route(name)
            if target is None:
                raise ValueError(f"unexpected tensor {original!r} in checkpoint for {type(self).__name__}")
            param, rows, convert = target
            if convert is not None:
                try:
                    tensor = convert(tensor)
                except RuntimeError as e:
                    raise ValueError(f"tensor {original!r} has shape {tuple(tensor.shape)}, "
                                     f"which does not fit {type(self).__name__}: {e}") from e
            # which dimension holds the outputs: rows of a Linear weight, columns of a packed 4-bit one
            dim = getattr(param, "output_dim", 0)
            dst = param.data if rows is None or dim is None else param.data.narrow(
                dim, rows.start, rows.stop - rows.start)
            if tuple(tensor.shape) != tuple(dst.shape):
                layout = f" (after conversion from the {self.quant.method} layout)" if self.quant else ""
                raise ValueError(f"shape mismatch for tensor {original!r}: checkpoint has {tuple(tensor.shape)}"
                                 f"{layout}, model expects {tuple(dst.shape)}")
            # cast on the host first so a GPU never holds an fp32 copy of a bf16 weight
            upload.copy(dst, tensor.to(dst.dtype))
            seen.add(name)
