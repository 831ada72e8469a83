"""Building blocks shared by the model files: uninitialised Linear/Embedding, norms that call
kernels/, config lookups, and the checkpoint-loading base class every model inherits.

Weights always come from a checkpoint or the dummy initialiser, so layers skip PyTorch's default
init: it would cost seconds on CPU for a real model and would touch memory twice on GPU.
"""

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay import kernels
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


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


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
        param = dict(self.named_parameters()).get(name)
        return None if param is None else (param, None, None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden] -> [S, vocab]; the matmul stays in model dtype, sampling wants fp32
        return F.linear(hidden, self.output_embedding()).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        expected = set(self.checkpoint_names())
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
            if self.ignored_names.search(name):
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # tied: the embedding is the one source of truth, as in HF's tie_weights
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
            dst = param.data if rows is None else param.data[rows]
            if tuple(tensor.shape) != tuple(dst.shape):
                raise ValueError(f"shape mismatch for tensor {original!r}: checkpoint has {tuple(tensor.shape)}, "
                                 f"model expects {tuple(dst.shape)}")
            # cast on the host first so a GPU never holds an fp32 copy of a bf16 weight
            upload.copy(dst, tensor.to(dst.dtype))
            seen.add(name)
