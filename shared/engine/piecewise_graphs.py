"""Steps that hold prompt tokens, replayed from CUDA graphs in pieces (vLLM's PIECEWISE cudagraph mode).

An eager mixed or prefill step launches every kernel from Python, which for an 8B model costs the host
more than the GPU's work on a small chunk; and its attention depends on how the step's tokens split into
sequences, so no one graph per token count can hold it. Everything else in a Llama block is row-wise, so
per token-count bucket T the pieces between attention calls are captured once, over static buffers of T
rows (a step pads up to its bucket; padding rows compute finite garbage nobody reads):

    piece 0:      embed -> layer 0's norm + qkv projection               -> qkv, residual
    attention i:  eager, on the step's real rows of qkv (rotary, KV write, paged attention) -> attn
    piece i + 1:  o_proj + residual + norm + MLP, then layer i+1's norm + qkv (the last piece: the final
                  norm)                                                  -> qkv, residual (or hidden)

Rotary and the KV write stay with attention (kernels/__init__.py ``rotary_attention``: one kernel rotates and
writes, then attention reads): they are one launch per layer, on the real rows only, so padding rows write no
KV and no static slot or position buffer is needed.
The LM head is left to the runner, as on the eager path: which rows need logits varies per step.

A step's launch cost is thus L + 1 replays plus L attention calls. Piece outputs are copied into the
static buffers inside each graph, so the intermediates of every piece and bucket come from one shared
graph pool (captured largest first; replays never overlap) instead of living on per layer.

``record=False`` runs the same pieces eagerly on the same static padded buffers: how the CPU tests prove
the padding and slicing without a GPU.
"""

import bisect
import logging
from collections import Counter

import torch
from torch import nn

from kvrelay import kernels
from kvrelay.shared.config.engine import PIECEWISE_MAX_TOKENS, EngineConfig
from kvrelay.shared.engine.cuda_graphs import capturable, capture_hold, capture_stream, record
from kvrelay.shared.engine.models.layers import norm_project, project
from kvrelay.shared.engine.models.llama import LlamaForCausalLM
from kvrelay.shared.engine.token_budget import max_batched_tokens

log = logging.getLogger(__name__)

MAX_TOKENS = PIECEWISE_MAX_TOKENS  # why this many: shared/config/engine.py


def token_buckets(max_tokens: int, smallest: int = 8) -> list[int]:
    """8, 12, 16, 24, ... 384, 512 (powers of two and their 1.5x), then every 128, up to and including ``max_tokens``.

    Up to a few hundred tokens a step reads the weights in the time it computes, so padding rows cost little
    and coarse buckets keep the graph count (L + 1 per bucket) and capture time down; past 512 the GEMMs are
    compute-bound and a padding row costs as much as a real one, so the buckets step by a fixed 128."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    sizes, p = [], smallest
    while p <= 512:
        sizes += [p, p * 3 // 2]
        p *= 2
    sizes += range(640, max_tokens + 1, 128)
    return sorted({s for s in sizes if s <= max_tokens} | {max_tokens})


def piecewise_tokens(config: EngineConfig, max_model_len: int) -> int:
    """The largest bucket: the step budget, at most MAX_TOKENS."""
    return min(max_batched_tokens(config.scheduler, max_model_len), MAX_TOKENS)


def unsupported(model: nn.Module) -> str:
    """Why ``model`` cannot run piecewise here ("" when it can)."""
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not of the Llama family"
    if model.parallel.world_size > 1 or model.stage.size > 1:
        return "tensor or pipeline parallelism"
    return ""


def capture_piecewise(model: nn.Module, kv_cache: torch.Tensor, config: EngineConfig, max_model_len: int
                      ) -> "PiecewiseGraphs | None":
    """The captured pieces of ``model`` (FULL_AND_PIECEWISE); None, said in the log, where they cannot be had.

    As vLLM downgrades a mode an attention backend lacks, a model the pieces do not cover keeps its decode
    graphs: one worker's models share the setting, and refusing it would refuse the whole worker."""
    why = unsupported(model)
    if why:  # info, not a warning: the mode is the default, and every other family lands here
        log.info("--cudagraph-mode FULL_AND_PIECEWISE: steps with prompt tokens of %s run eagerly (%s); "
                 "decode steps replay graphs as in FULL_DECODE_ONLY", config.model.model, why)
        return None
    pieces = PiecewiseGraphs(model, kv_cache, piecewise_tokens(config, max_model_len))
    return pieces if pieces.capture() else None


def static_bytes(model: LlamaForCausalLM, max_tokens: int) -> int:
    """What PiecewiseGraphs' static buffers hold for ``model`` at ``max_tokens`` rows (the KV profile counts it)."""
    attn = model.held_layers()[0][1].self_attn
    width = 2 * model.hidden_size + 2 * attn.q_size + 2 * attn.kv_size  # residual, hidden, attn, qkv
    return max_tokens * (4 + width * model.compute_dtype.itemsize)


class PiecewiseGraphs:
    """Static-buffer piecewise forward of one Llama-family model over its KV cache."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, max_tokens: int,
                 record: bool = True, sizes: list[int] | None = None) -> None:
        self.model, self.kv_cache, self.record = model, kv_cache, record
        self.sizes = sizes or token_buckets(max_tokens)
        self.max_tokens = self.sizes[-1]
        self.layers = [layer for _, layer in model.held_layers()]
        attn = self.layers[0].self_attn
        self.q_size, self.kv_size = attn.q_size, attn.kv_size
        dev, dtype, rows = kv_cache.device, model.compute_dtype, self.max_tokens
        self.ids = torch.zeros(rows, dtype=torch.int32, device=dev)
        self.qkv = torch.zeros(rows, self.q_size + 2 * self.kv_size, dtype=dtype, device=dev)
        self.residual = torch.zeros(rows, model.hidden_size, dtype=dtype, device=dev)
        self.attn = torch.zeros(rows, self.q_size, dtype=dtype, device=dev)
        self.hidden = torch.zeros(rows, model.hidden_size, dtype=dtype, device=dev)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (bucket, piece) -> graph
        self.num_replays = 0  # steps served here (tests check the path is really taken)
        self.replays_by_bucket: Counter[int] = Counter()

    @property
    def num_pieces(self) -> int:
        return len(self.layers) + 1

    @property
    def static_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ids, self.qkv, self.residual, self.attn, self.hidden))

    # -- the pieces ---------------------------------------------------------------------------------
    def _piece(self, rows: int, i: int) -> None:
        """Piece ``i`` over the first ``rows`` rows of the static buffers (fixed shapes per bucket)."""
        if i == 0:
            x, residual = self.model.model.embed_tokens(self.ids[:rows]), None
        else:
            layer = self.layers[i - 1]
            attn, mlp = layer.self_attn, layer.mlp
            x = attn.parallel.all_reduce(project(self.attn[:rows], attn.o_proj))
            gate_up, residual = norm_project(x, self.residual[:rows], layer.post_attention_layernorm,
                                             mlp.gate_up_proj)
            x = mlp(gate_up)
        if i == len(self.layers):
            hidden, _ = self.model.model.norm(x, residual)
            self.hidden[:rows].copy_(hidden)
            return
        nxt = self.layers[i]
        qkv, residual = norm_project(x, residual, nxt.input_layernorm, nxt.self_attn.qkv_proj)
        self.qkv[:rows].copy_(qkv)
        self.residual[:rows].copy_(residual)

    def _attention(self, i: int, n: int, positions: torch.Tensor, meta: kernels.AttentionMetadata) -> None:
        """Layer ``i``'s attention on the step's ``n`` real rows, eagerly (its shapes follow the step)."""
        attn = self.layers[i].self_attn
        q, k, v = self.qkv[:n].split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = kernels.rotary_attention(
            positions, q.view(n, attn.num_heads, attn.head_dim), k.view(n, attn.num_kv_heads, attn.head_dim),
            v.view(n, attn.num_kv_heads, attn.head_dim), self.model.cos_sin_cache, self.kv_cache[i], meta,
            attn.scale, attn.kv_scale)  # [n, H, D]
        self.attn[:n].copy_(out.reshape(n, self.q_size))

    def _run_piece(self, bucket: int, i: int) -> None:
        if self.record:
            self._graphs[bucket, i].replay()
        else:
            self._piece(bucket, i)

    # -- capture and replay -------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> bool:
        """Record every piece of every bucket, each bucket under the load's hold on its own as each decode graph
        is (cuda_graphs.py ``record``); False (and a warning) when a kernel cannot be captured. ``record=False``
        walks the same sequence, each piece run eagerly where it would be recorded."""
        hold = capture_hold()  # each bucket's own hold, below

        def every_piece() -> None:
            for i in range(self.num_pieces):
                self._piece(self.max_tokens, i)

        if not capturable(every_piece, self.record, "steps with prompt tokens run eagerly"):
            return False
        device = self.kv_cache.device
        pool = torch.cuda.graph_pool_handle() if self.record else None
        stream = capture_stream(device) if self.record else None
        for bucket in reversed(self.sizes):  # largest first: smaller buckets reuse its pool memory
            for i in range(self.num_pieces):  # compiles this shape's Triton specialisations outside the capture
                self._piece(bucket, i)
            # one hold per bucket, its L + 1 pieces: each piece is a fraction of a forward pass, and a hold apiece
            # would be hundreds per load, each a turn of the engine loop the load waits for
            with hold:
                for i in range(self.num_pieces):
                    if self.record:
                        self._graphs[bucket, i] = record(lambda bucket=bucket, i=i: self._piece(bucket, i), pool,
                                                         stream)
                    else:
                        self._piece(bucket, i)
        if self.record:  # this thread's work alone, as cuda_graphs.py says
            torch.cuda.current_stream(device).synchronize()
            log.info("captured %d piecewise CUDA graphs (%d pieces x token buckets %s)", len(self._graphs),
                     self.num_pieces, self.sizes)
        return True

    def bucket(self, num_tokens: int) -> int | None:
        """Smallest bucket >= ``num_tokens``; None past the largest (that step runs eagerly)."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def fits(self, num_tokens: int) -> bool:
        # a layer calibrating its fp8 KV scales (kv_calibration.py) measures inside its own eager forward
        return num_tokens <= self.max_tokens and not any(layer.self_attn.kv_scale_pending for layer in self.layers)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: kernels.AttentionMetadata
            ) -> torch.Tensor:
        """The final hidden states [T, hidden] of a step of T = len(input_ids) tokens: a view into a static
        buffer, valid until the next call. ``input_ids``, ``positions``, ``meta``: the step's own (device)."""
        n = input_ids.shape[0]
        bucket = self.bucket(n)
        if bucket is None:
            raise ValueError(f"a step of {n} tokens exceeds the largest piecewise bucket ({self.max_tokens})")
        self.ids[:n].copy_(input_ids)  # rows n..bucket keep earlier ids: valid tokens, read by no real row
        self._run_piece(bucket, 0)
        for i in range(len(self.layers)):
            self._attention(i, n, positions, meta)
            self._run_piece(bucket, i + 1)
        self.num_replays += 1
        self.replays_by_bucket[bucket] += 1
        return self.hidden[:n]
