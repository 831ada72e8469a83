"""Llama family: Llama 2/3 (incl. llama3 RoPE scaling), Mistral, Qwen2 (qkv bias), SmolLM2 (tied
embeddings). Attends through kernels/ over the paged KV cache.

q/k/v live in one ``qkv_proj`` and gate/up in one ``gate_up_proj`` (stacked at load time), so a
step runs two matmuls per block instead of five, which the GPU path depends on.
"""

import re
from functools import partial

import torch
from torch import nn

from kvrelay import kernels
from kvrelay.shared.engine.kv_dtype import measure_kv_scale
from kvrelay.shared.engine.models.layers import (
    CausalLM,
    RMSNorm,
    Route,
    cfg_get,
    linear_names,
    linear_route,
    lm_head,
    norm_project,
    project,
    quant_linear,
    silu_project,
    vocab_embedding,
)
from kvrelay.shared.engine.models.rope import build_cos_sin_cache
from kvrelay.shared.engine.parallel import linear as tp
from kvrelay.shared.engine.parallel.pipeline import WHOLE, MissingLayer, PipelineStage
from kvrelay.shared.engine.parallel.state import SINGLE, ParallelState
from kvrelay.shared.engine.quant.config import QuantConfig


class LlamaAttention(nn.Module):
    kv_scale: torch.Tensor | None = None  # [2] float32 (K, V) of an fp8 KV cache (shared/engine/kv_dtype.py)
    kv_scale_pending: bool = False  # --calculate-kv-scales: the next forward sets kv_scale (kv_calibration.py)

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 qkv_bias: bool, o_bias: bool, dtype: torch.dtype, quant: QuantConfig | None = None,
                 parallel: ParallelState = SINGLE) -> None:
        # num_heads, num_kv_heads: this rank's (all of them without tensor parallelism)
        super().__init__()
        self.parallel = parallel
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim ** -0.5
        self.qkv_proj = quant_linear(hidden, self.q_size + 2 * self.kv_size, qkv_bias, dtype, quant)
        self.o_proj = quant_linear(self.q_size, hidden, o_bias, dtype, quant)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, kv_cache: torch.Tensor,
                meta: kernels.AttentionMetadata, cos_sin_cache: torch.Tensor) -> torch.Tensor:
        # qkv: [T, (H + 2 Hkv) D], projected by the layer (which fuses its norm into the projection);
        # kv_cache: [2, num_blocks, block_size, Hkv, D]
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.kv_scale_pending:  # the scales come from the keys as stored, after rotary, before their write
            self.kv_scale_pending = False
            q, k = kernels.rotary_embedding(positions, q, k, cos_sin_cache)
            measure_kv_scale(self.kv_scale, k, v, meta.slot_mapping)
            kernels.write_kv(k, v, kv_cache, meta.slot_mapping, self.kv_scale)
            out = kernels.paged_attention(q, kv_cache, meta, self.scale, k=k, v=v, kv_scale=self.kv_scale)
            return self.parallel.all_reduce(project(out.reshape(num_tokens, self.q_size), self.o_proj))
        # rotary, the KV write and attention: one kernel for a decode step, two otherwise (kernels/__init__.py)
        out = kernels.rotary_attention(positions, q, k, v, cos_sin_cache, kv_cache, meta, self.scale,
                                       self.kv_scale)  # [T, H, D]
        return self.parallel.all_reduce(project(out.reshape(num_tokens, self.q_size), self.o_proj))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool, dtype: torch.dtype,
                 quant: QuantConfig | None = None, parallel: ParallelState = SINGLE) -> None:
        # intermediate: this rank's share
        super().__init__()
        self.parallel = parallel
        self.gate_up_proj = quant_linear(hidden, 2 * intermediate, bias, dtype, quant)  # rows: gate | up
        self.down_proj = quant_linear(intermediate, hidden, bias, dtype, quant)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        # gate_up: [T, 2I], projected by the layer (which fuses its norm into the projection) -> [T, hidden]
        return self.parallel.all_reduce(silu_project(gate_up, self.down_proj))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, attn: LlamaAttention, mlp: LlamaMLP, hidden: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: kernels.AttentionMetadata,
                cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the residual stream is carried separately so each norm fuses the preceding add, and each norm
        # runs inside the projection after it where the step is one token (kernels/triton/skinny_linear.py)
        attn, mlp, norm1, norm2 = self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm
        qkv, residual = norm_project(x, residual, norm1, attn.qkv_proj)
        x = attn(positions, qkv, kv_cache, meta, cos_sin_cache)
        gate_up, residual = norm_project(x, residual, norm2, mlp.gate_up_proj)
        return mlp(gate_up), residual


class LlamaModel(nn.Module):
    def __init__(self, layers: list[LlamaDecoderLayer], vocab: int, hidden: int, eps: float,
                 dtype: torch.dtype, parallel: ParallelState) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(vocab, hidden, dtype, parallel)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, eps, dtype)


class LlamaForCausalLM(CausalLM):
    embedding_module = "model.embed_tokens"
    last_stage_modules = ("model.norm", "lm_head")
    carried_tensors = 2  # the hidden states and the residual stream
    ignored_names = re.compile(r"rotary_emb\.inv_freq$")  # a buffer some old checkpoints saved
    vocab_tensors = ("model.embed_tokens.weight", "lm_head.weight")
    # weight and bias, or a 4-bit format's tensors (an int8 / fp8 weight_scale is per output: never cut)
    _row_parallel = re.compile(r"model\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.(weight|bias|qweight|qzeros|"
                               r"scales|g_idx)$")

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32, quant: QuantConfig | None = None,
                 parallel: ParallelState = SINGLE, stage: PipelineStage = WHOLE) -> None:
        super().__init__()
        self.quant = quant
        self.parallel = p = parallel
        act = hf_config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{type(self).__name__} supports hidden_act 'silu' only, got {act!r}")
        self.hidden_size = hidden = cfg_get(hf_config, "hidden_size")
        num_heads = cfg_get(hf_config, "num_attention_heads")
        self.num_layers = cfg_get(hf_config, "num_hidden_layers")
        num_kv_heads = cfg_get(hf_config, "num_key_value_heads", default=num_heads)
        self.head_dim = cfg_get(hf_config, "head_dim", default=hidden // num_heads)
        self.vocab_size = cfg_get(hf_config, "vocab_size")
        # this rank's query heads, KV heads and intermediate rows (shared/engine/parallel/linear.py)
        self.q_heads = tp.even(num_heads, p.rank, p.world_size, "the attention heads")
        self.kv_heads = tp.kv_heads(num_kv_heads, p.rank, p.world_size)
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads, self.num_kv_heads = self.q_heads[1], self.kv_heads[1]
        self.intermediate_size = tp.even(cfg_get(hf_config, "intermediate_size"), p.rank, p.world_size,
                                         "the intermediate size")[1]
        self.tie_word_embeddings = bool(hf_config.get("tie_word_embeddings", False))
        # Mistral v0.1 attends over a 4096-token window; the kernels attend over everything, so the
        # engine must cap max_model_len at this to stay exact
        self.sliding_window: int | None = (
            hf_config.get("sliding_window") if self._uses_sliding_window(hf_config) else None)
        eps = cfg_get(hf_config, "rms_norm_eps", default=1e-6)
        qkv_bias, o_bias = self._attention_biases(hf_config)
        mlp_bias = bool(hf_config.get("mlp_bias", False))
        layers = [
            LlamaDecoderLayer(
                LlamaAttention(hidden, self.num_heads, self.num_kv_heads, self.head_dim, qkv_bias, o_bias, dtype,
                               quant, p),
                LlamaMLP(hidden, self.intermediate_size, mlp_bias, dtype, quant, p), hidden, eps, dtype)
            if stage.holds(i) else MissingLayer()
            for i in range(self.num_layers)
        ]
        self.model = LlamaModel(layers, self.vocab_size, hidden, eps, dtype, p)
        if not self.tie_word_embeddings:
            self.lm_head = lm_head(hidden, self.vocab_size, dtype, p)
        max_positions = cfg_get(hf_config, "max_position_embeddings", default=2048)
        cache = build_cos_sin_cache(hf_config, self.head_dim, max_positions)  # [max_pos, rot_dim] fp32
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.prune_to_stage(stage)

    def _attention_biases(self, hf_config: dict) -> tuple[bool, bool]:
        bias = bool(hf_config.get("attention_bias", False))
        return bias, bias

    def _uses_sliding_window(self, hf_config: dict) -> bool:
        return hf_config.get("sliding_window") is not None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: kernels.AttentionMetadata, carried: tuple[torch.Tensor, ...] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        # input_ids, positions: [T]; kv_caches: [L, 2, num_blocks, block_size, Hkv, D] -> [T, hidden]
        # (a pipeline stage: its own L layers; ``carried`` is the previous stage's output, and a stage
        # before the last returns (hidden, residual) for the next)
        x, residual = (self.model.embed_tokens(input_ids), None) if carried is None else carried
        first = self.stage.start
        for i in self.stage.layers(self.num_layers):
            x, residual = self.model.layers[i](positions, x, residual, kv_caches[i - first], meta, self.cos_sin_cache)
        if not self.stage.last:
            return x, residual
        x, _ = self.model.norm(x, residual)
        return x

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def output_embedding(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    # the suffix: weight / bias, or a quantized format's tensors (qweight, scales, weight_scale, ...)
    _stacked = re.compile(r"model\.layers\.(\d+)\.(self_attn\.[qkv]|mlp\.gate|mlp\.up)_proj\.(\w+)$")

    def route(self, name: str) -> Route | None:
        match = self._stacked.match(name)
        if match is None:
            return super().route(name)
        index, which, kind = int(match[1]), match[2], match[3]
        if index >= self.num_layers:
            return None
        layer = self.model.layers[index]
        q, kv, inter = layer.self_attn.q_size, layer.self_attn.kv_size, self.intermediate_size
        fused, rows = {
            "self_attn.q": (layer.self_attn.qkv_proj, slice(0, q)),
            "self_attn.k": (layer.self_attn.qkv_proj, slice(q, q + kv)),
            "self_attn.v": (layer.self_attn.qkv_proj, slice(q + kv, q + 2 * kv)),
            "mlp.gate": (layer.mlp.gate_up_proj, slice(0, inter)),
            "mlp.up": (layer.mlp.gate_up_proj, slice(inter, 2 * inter)),
        }[which]
        return linear_route(fused, kind, rows, self._fused_shard(which))

    def _fused_shard(self, which: str):
        """This rank's part of a q, k, v, gate or up tensor: its query heads, its KV heads, its rows."""
        p = self.parallel
        if p.world_size == 1:
            return None
        if which == "self_attn.q":
            return partial(tp.heads, num_heads=self.total_num_heads, first=self.q_heads[0], count=self.q_heads[1])
        if which in ("self_attn.k", "self_attn.v"):
            return partial(tp.heads, num_heads=self.total_num_kv_heads, first=self.kv_heads[0],
                           count=self.kv_heads[1])
        return partial(tp.column, rank=p.rank, world=p.world_size)

    def shard(self, name: str):
        p = self.parallel
        match = self._row_parallel.match(name) if p.world_size > 1 else None
        if match is None:
            return super().shard(name)
        if match[2] == "bias":
            return partial(tp.row_bias, rank=p.rank)
        return partial(tp.row, rank=p.rank, world=p.world_size)

    def checkpoint_names(self) -> list[str]:
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.tie_word_embeddings:
            names.append("lm_head.weight")
        for i, layer in self.held_layers():
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            names += linear_names(p + "self_attn.o_proj", attn.o_proj) + linear_names(p + "mlp.down_proj", mlp.down_proj)
            for proj in ("q", "k", "v"):
                names += linear_names(f"{p}self_attn.{proj}_proj", attn.qkv_proj)
            for proj in ("gate", "up"):
                names += linear_names(f"{p}mlp.{proj}_proj", mlp.gate_up_proj)
        return names


class MistralForCausalLM(LlamaForCausalLM):
    """Same blocks as Llama, no biases; differs only in config (sliding_window)."""

    def _attention_biases(self, hf_config: dict) -> tuple[bool, bool]:
        return False, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama blocks with a bias on q/k/v (always, per the Qwen2 architecture) and none on o."""

    def _attention_biases(self, hf_config: dict) -> tuple[bool, bool]:
        return True, False

    def _uses_sliding_window(self, hf_config: dict) -> bool:
        return bool(hf_config.get("use_sliding_window", False)) and hf_config.get("sliding_window") is not None
