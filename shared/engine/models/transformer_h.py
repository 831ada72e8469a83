"""What GPT-2 and BLOOM share: HF's ``transformer.`` layout (the decoder blocks in ``transformer.h``, a final
LayerNorm ``transformer.ln_f``, checkpoints sometimes saved without the prefix), the config keys of their
heads and layers, multi-head attention through one fused q | k | v projection, and row-parallel output
projections whose bias rank 0 alone adds."""

from functools import partial

import torch
from torch import nn

from kvrelay import kernels
from kvrelay.shared.engine.kv_dtype import measure_kv_scale
from kvrelay.shared.engine.models.layers import CausalLM, cfg_get, on_the_fly_only
from kvrelay.shared.engine.parallel import linear as tp
from kvrelay.shared.engine.parallel.state import SINGLE, ParallelState
from kvrelay.shared.engine.quant.config import QuantConfig


class FusedQKVAttention(nn.Module):
    """As many KV heads as query heads, q | k | v from one projection; a subclass builds its two projections
    under its checkpoint's names and passes them to ``attend``."""

    kv_scale: torch.Tensor | None = None  # [2] float32 (K, V) of an fp8 KV cache (shared/engine/kv_dtype.py)
    kv_scale_pending: bool = False  # --calculate-kv-scales: the next forward sets kv_scale (kv_calibration.py)

    def __init__(self, num_heads: int, head_dim: int, scale: float, parallel: ParallelState = SINGLE) -> None:
        # num_heads: this rank's; the output projection's bias is rank 0's alone, so the all-reduce adds it once
        super().__init__()
        self.num_heads, self.head_dim, self.width = num_heads, head_dim, num_heads * head_dim
        self.scale = scale
        self.parallel = parallel

    def attend(self, qkv_proj: nn.Module, out_proj: nn.Module, x: torch.Tensor, kv_cache: torch.Tensor,
               meta: kernels.AttentionMetadata, slopes: torch.Tensor | None = None) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = qkv_proj(x).view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)  # 3 x [T, H, D]
        if self.kv_scale_pending:
            self.kv_scale_pending = False
            measure_kv_scale(self.kv_scale, k, v, meta.slot_mapping)
        kernels.write_kv(k, v, kv_cache, meta.slot_mapping, self.kv_scale)
        out = kernels.paged_attention(q, kv_cache, meta, self.scale, slopes, kv_scale=self.kv_scale)  # [T, H, D]
        return self.parallel.all_reduce(out_proj(out.reshape(num_tokens, self.width)))


class TransformerH(CausalLM):
    """A model whose ``transformer`` holds ``h`` (its blocks, each called as ``block(x, kv_cache, meta,
    *extra)``) and ``ln_f``."""

    def read_heads(self, hf_config: dict, hidden: int, quant: QuantConfig | None, parallel: ParallelState) -> int:
        """Sets what the engine reads of the model (its layers, this rank's heads, ...) and returns the index
        of this rank's first head among all."""
        on_the_fly_only(quant, type(self).__name__)
        self.quant = quant
        self.parallel = p = parallel
        self.hidden_size = hidden
        self.total_num_heads = cfg_get(hf_config, "n_head", "num_attention_heads")
        self.num_layers = cfg_get(hf_config, "n_layer", "num_hidden_layers")
        first, self.num_heads = tp.even(self.total_num_heads, p.rank, p.world_size, "the attention heads")
        self.num_kv_heads = self.num_heads
        self.head_dim = hidden // self.total_num_heads
        self.vocab_size = cfg_get(hf_config, "vocab_size")
        self.tie_word_embeddings = bool(hf_config.get("tie_word_embeddings", True))
        return first

    def run_layers(self, x: torch.Tensor, kv_caches: torch.Tensor, meta: kernels.AttentionMetadata,
                   *extra: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """This stage's blocks over ``x``; a stage before the last returns (hidden,) for the next."""
        first = self.stage.start
        for i in self.stage.layers(self.num_layers):
            x = self.transformer.h[i](x, kv_caches[i - first], meta, *extra)
        return self.transformer.ln_f(x) if self.stage.last else (x,)

    def decoder_layers(self) -> nn.ModuleList:
        return self.transformer.h

    def output_embedding(self) -> torch.Tensor:
        return self.get_submodule(self.embedding_module).weight if self.tie_word_embeddings else self.lm_head.weight

    def normalize_name(self, name: str) -> str:
        # the original checkpoints (openai-community, bigscience) were saved from the inner model, unprefixed
        return name if name.startswith("transformer.") or name == "lm_head.weight" else "transformer." + name

    def column_or_row(self, column: bool, kind: str):
        """This rank's cut of a column-parallel projection's tensor, or of a row-parallel one's ``kind``
        ("weight" or "bias")."""
        p = self.parallel
        if column:
            return partial(tp.column, rank=p.rank, world=p.world_size)
        if kind == "bias":
            return partial(tp.row_bias, rank=p.rank)
        return partial(tp.row, rank=p.rank, world=p.world_size)
