"""BLOOM: ALiBi instead of positions, LayerNorm after the embedding, tanh GELU, tied lm_head.

HF's fused ``query_key_value`` interleaves heads (its output viewed as [num_heads, 3, head_dim]);
it is regrouped at load to [3, num_heads, head_dim] (q | k | v), the fused layout every model
here shares, so the forward splits it the same way Llama does.
"""

import math
import re

import torch
from torch import nn

from kvrelay import kernels
from kvrelay.shared.engine.models.layers import (
    LayerNorm,
    Route,
    cfg_get,
    linear_names,
    lm_head,
    quant_linear,
    submodule_route,
    vocab_embedding,
)
from kvrelay.shared.engine.models.transformer_h import FusedQKVAttention, TransformerH
from kvrelay.shared.engine.parallel import linear as tp
from kvrelay.shared.engine.parallel.pipeline import WHOLE, MissingLayer, PipelineStage
from kvrelay.shared.engine.parallel.state import SINGLE, ParallelState
from kvrelay.shared.engine.quant.config import QuantConfig


def alibi_slopes(num_heads: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Per-head ALiBi slopes [H] float32, the same arithmetic as HF's BLOOM (incl. non-power-of-2 H)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = torch.full((), 2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32, device=device)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32, device=device))
    if closest != num_heads:
        extra_base = torch.full((), 2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32, device=device)
        remaining = min(closest, num_heads - closest)
        extra = torch.pow(extra_base, torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.int32, device=device))
        slopes = torch.cat([slopes, extra])
    return slopes


def _regroup_qkv(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    # [H * 3 * D, ...] (HF: per head q, k, v) -> [3 * H * D, ...] (q of all heads | k | v)
    head_dim = t.shape[0] // (3 * num_heads)
    return t.reshape(num_heads, 3, head_dim, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


class BloomAttention(FusedQKVAttention):
    def __init__(self, hidden: int, num_heads: int, head_dim: int, dtype: torch.dtype,
                 quant: QuantConfig | None = None, parallel: ParallelState = SINGLE) -> None:
        super().__init__(num_heads, head_dim, head_dim ** -0.5, parallel)
        self.query_key_value = quant_linear(hidden, 3 * self.width, True, dtype, quant)  # q | k | v after load
        self.dense = quant_linear(self.width, hidden, True, dtype, quant)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: kernels.AttentionMetadata,
                slopes: torch.Tensor) -> torch.Tensor:
        return self.attend(self.query_key_value, self.dense, x, kv_cache, meta, slopes)


class BloomMLP(nn.Module):
    def __init__(self, hidden: int, dtype: torch.dtype, quant: QuantConfig | None = None,
                 parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        self.parallel = parallel
        inner = tp.even(4 * hidden, parallel.rank, parallel.world_size, "the MLP size")[1]
        self.dense_h_to_4h = quant_linear(hidden, inner, True, dtype, quant)
        self.dense_4h_to_h = quant_linear(inner, hidden, True, dtype, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce(self.dense_4h_to_h(kernels.gelu(self.dense_h_to_4h(x), "tanh")))


class BloomBlock(nn.Module):
    def __init__(self, hidden: int, num_heads: int, head_dim: int, eps: float, post_ln_residual: bool,
                 dtype: torch.dtype, quant: QuantConfig | None = None, parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = LayerNorm(hidden, eps, dtype)
        self.self_attention = BloomAttention(hidden, num_heads, head_dim, dtype, quant, parallel)
        self.post_attention_layernorm = LayerNorm(hidden, eps, dtype)
        self.mlp = BloomMLP(hidden, dtype, quant, parallel)
        self.post_ln_residual = post_ln_residual  # apply_residual_connection_post_layernorm

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: kernels.AttentionMetadata,
                slopes: torch.Tensor) -> torch.Tensor:
        normed = self.input_layernorm(x)
        residual = normed if self.post_ln_residual else x
        x = self.self_attention(normed, kv_cache, meta, slopes) + residual
        normed = self.post_attention_layernorm(x)
        residual = normed if self.post_ln_residual else x
        return self.mlp(normed) + residual


class BloomModel(nn.Module):
    def __init__(self, blocks: list[BloomBlock], vocab: int, hidden: int, eps: float, dtype: torch.dtype,
                 parallel: ParallelState) -> None:
        super().__init__()
        self.word_embeddings = vocab_embedding(vocab, hidden, dtype, parallel)
        self.word_embeddings_layernorm = LayerNorm(hidden, eps, dtype)
        self.h = nn.ModuleList(blocks)
        self.ln_f = LayerNorm(hidden, eps, dtype)


class BloomForCausalLM(TransformerH):
    has_position_limit = False
    _qkv = re.compile(r"\.self_attention\.query_key_value\.(weight|bias)$")
    _split = re.compile(r"\.(self_attention\.dense|mlp\.dense_h_to_4h|mlp\.dense_4h_to_h)\.(weight|bias)$")
    vocab_tensors = ("transformer.word_embeddings.weight", "lm_head.weight")
    embedding_module = "transformer.word_embeddings"
    first_stage_modules = ("transformer.word_embeddings_layernorm",)
    last_stage_modules = ("transformer.ln_f", "lm_head")

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32, quant: QuantConfig | None = None,
                 parallel: ParallelState = SINGLE, stage: PipelineStage = WHOLE) -> None:
        super().__init__()
        hidden = cfg_get(hf_config, "hidden_size", "n_embed")
        first = self.read_heads(hf_config, hidden, quant, parallel)
        p = parallel
        eps = cfg_get(hf_config, "layer_norm_epsilon", default=1e-5)
        post_ln = bool(hf_config.get("apply_residual_connection_post_layernorm", False))
        blocks = [BloomBlock(hidden, self.num_heads, self.head_dim, eps, post_ln, dtype, quant, p)
                  if stage.holds(i) else MissingLayer() for i in range(self.num_layers)]
        self.transformer = BloomModel(blocks, self.vocab_size, hidden, eps, dtype, p)
        if not self.tie_word_embeddings:
            self.lm_head = lm_head(hidden, self.vocab_size, dtype, p)
        # a head's slope depends on its index among all heads: this rank's slice of the whole set
        slopes = alibi_slopes(self.total_num_heads)[first:first + self.num_heads]
        self.register_buffer("alibi_slopes", slopes, persistent=False)  # [H] fp32
        self.prune_to_stage(stage)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: kernels.AttentionMetadata, carried: tuple[torch.Tensor, ...] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        # positions are unused: ALiBi biases by key position, which the kernel derives from the cache.
        # A pipeline stage before the last returns (hidden,) for the next, which passes it as ``carried``.
        if carried is None:
            x = self.transformer.word_embeddings_layernorm(self.transformer.word_embeddings(input_ids))  # [T, hidden]
        else:
            x = carried[0]
        return self.run_layers(x, kv_caches, meta, self.alibi_slopes)

    def route(self, name: str) -> Route | None:
        if self._qkv.search(name):  # this rank's heads (still interleaved), then regrouped
            p, total = self.parallel, self.total_num_heads
            return submodule_route(self, name, lambda t: _regroup_qkv(
                tp.interleaved_qkv(t, total, p.rank, p.world_size), self.num_heads))
        return super().route(name)

    def shard(self, name: str):
        p = self.parallel
        match = self._split.search(name) if p.world_size > 1 else None
        if match is None:
            return super().shard(name)
        return self.column_or_row(match[1] == "mlp.dense_h_to_4h", match[2])

    def checkpoint_names(self) -> list[str]:
        names = ["transformer.word_embeddings.weight"]
        names += [f"transformer.{m}.{k}" for m in ("word_embeddings_layernorm", "ln_f") for k in ("weight", "bias")]
        if not self.tie_word_embeddings:
            names.append("lm_head.weight")
        norms = ("input_layernorm", "post_attention_layernorm")
        projections = ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h",
                       "mlp.dense_4h_to_h")
        for i, _ in self.held_layers():
            names += [f"transformer.h.{i}.{m}.{k}" for m in norms for k in ("weight", "bias")]
            names += [n for m in projections
                      for n in linear_names(f"transformer.h.{i}.{m}", self.get_submodule(f"transformer.h.{i}.{m}"))]
        return names
