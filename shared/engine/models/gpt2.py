"""GPT-2: learned absolute positions, pre-LayerNorm blocks, tanh GELU, lm_head tied to wte.

HF stores GPT-2's projections as Conv1D, whose weight is [in, out] (the transpose of a Linear);
they are transposed once at load so the forward is plain Linear. ``c_attn`` is already q|k|v
stacked along its output, which is exactly the fused layout.
"""

import re
from functools import partial

import torch
from torch import nn

from kvrelay import kernels
from kvrelay.shared.engine.models.layers import (
    Embedding,
    LayerNorm,
    Route,
    cfg_get,
    linear_names,
    lm_head,
    quant_linear,
    split_cut,
    submodule_route,
    vocab_embedding,
)
from kvrelay.shared.engine.models.transformer_h import FusedQKVAttention, TransformerH
from kvrelay.shared.engine.parallel import linear as tp
from kvrelay.shared.engine.parallel.pipeline import WHOLE, MissingLayer, PipelineStage
from kvrelay.shared.engine.parallel.state import SINGLE, ParallelState
from kvrelay.shared.engine.quant.config import QuantConfig

# HF activation name -> torch gelu `approximate`; gelu_new is the tanh form
_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}


class GPT2Attention(FusedQKVAttention):
    def __init__(self, hidden: int, num_heads: int, head_dim: int, scale: float, dtype: torch.dtype,
                 quant: QuantConfig | None = None, parallel: ParallelState = SINGLE) -> None:
        super().__init__(num_heads, head_dim, scale, parallel)
        self.c_attn = quant_linear(hidden, 3 * self.width, True, dtype, quant)  # rows: q | k | v
        self.c_proj = quant_linear(self.width, hidden, True, dtype, quant)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: kernels.AttentionMetadata) -> torch.Tensor:
        return self.attend(self.c_attn, self.c_proj, x, kv_cache, meta)


class GPT2MLP(nn.Module):
    def __init__(self, hidden: int, inner: int, approximate: str, dtype: torch.dtype,
                 quant: QuantConfig | None = None, parallel: ParallelState = SINGLE) -> None:
        # inner: this rank's share
        super().__init__()
        self.parallel = parallel
        self.c_fc = quant_linear(hidden, inner, True, dtype, quant)
        self.c_proj = quant_linear(inner, hidden, True, dtype, quant)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce(self.c_proj(kernels.gelu(self.c_fc(x), self.approximate)))


class GPT2Block(nn.Module):
    def __init__(self, attn: GPT2Attention, mlp: GPT2MLP, hidden: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(hidden, eps, dtype)
        self.attn = attn
        self.ln_2 = LayerNorm(hidden, eps, dtype)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: kernels.AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, meta)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, blocks: list[GPT2Block], vocab: int, positions: int, hidden: int, eps: float,
                 dtype: torch.dtype, parallel: ParallelState) -> None:
        super().__init__()
        self.wte = vocab_embedding(vocab, hidden, dtype, parallel)
        self.wpe = Embedding(positions, hidden, dtype=dtype)
        self.h = nn.ModuleList(blocks)
        self.ln_f = LayerNorm(hidden, eps, dtype)


class GPT2LMHeadModel(TransformerH):
    # causal-mask buffers older checkpoints saved next to the weights
    ignored_names = re.compile(r"^transformer\.h\.\d+\.attn\.(bias|masked_bias)$")
    _conv1d = re.compile(r"\.(c_attn|c_proj|c_fc)\.weight$")
    _split = re.compile(r"\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.(weight|bias)$")
    vocab_tensors = ("transformer.wte.weight", "lm_head.weight")
    embedding_module = "transformer.wte"
    first_stage_modules = ("transformer.wpe",)
    last_stage_modules = ("transformer.ln_f", "lm_head")

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32, quant: QuantConfig | None = None,
                 parallel: ParallelState = SINGLE, stage: PipelineStage = WHOLE) -> None:
        super().__init__()
        act = cfg_get(hf_config, "activation_function", default="gelu_new")
        if act not in _GELU:
            raise ValueError(f"GPT2LMHeadModel supports activation_function in {sorted(_GELU)}, got {act!r}")
        if hf_config.get("add_cross_attention"):
            raise ValueError("GPT2LMHeadModel with cross-attention is not supported")
        hidden = cfg_get(hf_config, "n_embd", "hidden_size")
        self.read_heads(hf_config, hidden, quant, parallel)
        p = parallel
        self.max_positions = cfg_get(hf_config, "n_positions", "max_position_embeddings")
        inner = tp.even(cfg_get(hf_config, "n_inner", default=4 * hidden), p.rank, p.world_size,
                        "the inner size")[1]
        eps = cfg_get(hf_config, "layer_norm_epsilon", default=1e-5)
        blocks = []
        for i in range(self.num_layers):
            if not stage.holds(i):
                blocks.append(MissingLayer())
                continue
            scale = self.head_dim ** -0.5 if hf_config.get("scale_attn_weights", True) else 1.0
            if hf_config.get("scale_attn_by_inverse_layer_idx", False):
                scale /= i + 1
            blocks.append(GPT2Block(GPT2Attention(hidden, self.num_heads, self.head_dim, scale, dtype, quant, p),
                                    GPT2MLP(hidden, inner, _GELU[act], dtype, quant, p), hidden, eps, dtype))
        self.transformer = GPT2Model(blocks, self.vocab_size, self.max_positions, hidden, eps, dtype, p)
        if not self.tie_word_embeddings:
            self.lm_head = lm_head(hidden, self.vocab_size, dtype, p)
        self.prune_to_stage(stage)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: kernels.AttentionMetadata, carried: tuple[torch.Tensor, ...] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        # input_ids, positions: [T] -> [T, hidden] (a pipeline stage before the last: (hidden,))
        x = self.transformer.wte(input_ids) + self.transformer.wpe(positions) if carried is None else carried[0]
        return self.run_layers(x, kv_caches, meta)

    def route(self, name: str) -> Route | None:
        if self._conv1d.search(name):  # Conv1D [in, out] -> Linear [out, in], then this rank's part
            outputs, inputs = split_cut(self.shard(name))
            return submodule_route(self, name, lambda w: w.t() if outputs is None else outputs(w.t()), inputs)
        return super().route(name)  # biases: the base route applies ``shard`` too

    def shard(self, name: str):
        p = self.parallel
        match = self._split.search(name) if p.world_size > 1 else None
        if match is None:
            return super().shard(name)
        module, kind = match[1], match[2]
        if module == "attn.c_attn":  # q | k | v, each split by heads
            return partial(tp.stacked_qkv, num_heads=self.total_num_heads, rank=p.rank, world=p.world_size)
        return self.column_or_row(module == "mlp.c_fc", kind)  # else the c_proj of either: row-parallel

    def checkpoint_names(self) -> list[str]:
        names = ["transformer.wte.weight", "transformer.wpe.weight",
                 "transformer.ln_f.weight", "transformer.ln_f.bias"]
        if not self.tie_word_embeddings:
            names.append("lm_head.weight")
        for i, _ in self.held_layers():
            for module in ("ln_1", "ln_2"):
                names += [f"transformer.h.{i}.{module}.weight", f"transformer.h.{i}.{module}.bias"]
            for module in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
                names += linear_names(f"transformer.h.{i}.{module}", self.get_submodule(f"transformer.h.{i}.{module}"))
        return names
