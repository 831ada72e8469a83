"""What a KV handoff (shared/handoff) asks of the model runner, through the engine's KV connector
(kv_connector.py): a finishing prompt's KV streamed out layer by layer while later layers compute, and
whole blocks (every layer, every head) out of and into the cache, for a handoff between any parallel
layouts, and each rank's own part sent straight to the decode worker. A mixin of ModelRunner (model_runner.py), which sets the attributes declared below.
"""

import torch
import zmq

from kvrelay.kernels import AttentionMetadata
from kvrelay.shared.engine.ranks.group import RankGroup
from kvrelay.shared.engine.ranks.kv_moves import driver_export, driver_import, stage_layers, total_kv_heads
from kvrelay.shared.engine.ranks.kv_parts import PartSender, driver_send
from kvrelay.shared.engine.scheduler_output import SchedulerOutput
from kvrelay.shared.wire.rank_step import RankKVSend


class HandoffHooks:
    model: torch.nn.Module
    ranks: RankGroup | None
    kv_cache: torch.Tensor
    parts: PartSender | None  # with kv_links: each rank sends its own part (ranks/kv_parts.py)
    kv_stream = None  # see set_kv_stream
    _streaming = _hooked = False

    # -- layer-by-layer streaming -----------------------------------------------------------------
    def set_kv_stream(self, stream) -> None:
        """A prefill worker's layer-by-layer handoff (shared/handoff/layer_stream.py ``LayerStream``): told
        before each eager forward which prompts it finishes, and after each decoder layer that the layer's
        KV is written (queued on the compute stream), so their KV can leave while later layers compute."""
        if self.ranks is not None:
            raise ValueError("layer-by-layer KV streaming does not support tensor_parallel_size > 1 yet")
        if self.kv_stream is None and not self._hooked:
            self._hooked = True
            for i, layer in enumerate(self.model.decoder_layers()):
                layer.register_forward_hook(lambda _mod, _args, _out, i=i: self._layer_done(i))
        self.kv_stream = stream

    def _layer_done(self, layer: int) -> None:
        if self._streaming:
            self.kv_stream.layer_done(layer)

    def _forward(self, out: SchedulerOutput, t, meta: AttentionMetadata) -> torch.Tensor:
        """The eager forward, reporting layers to ``kv_stream`` when this step finishes a prompt it wants."""
        if self.kv_stream is not None:
            finishing = [(sr.request.request_id, sr.block_ids) for sr in out.scheduled
                         if sr.request.num_computed_tokens < sr.request.num_prompt_tokens
                         and sr.request.num_computed_tokens + sr.num_new_tokens == sr.request.num_tokens]
            self._streaming = bool(finishing) and self.kv_stream.begin(finishing)
        try:
            return self.model(t.input_ids, t.positions, self.kv_cache, meta)  # [T, hidden]
        finally:
            if self._streaming:
                self._streaming = False
                self.kv_stream.end()

    # -- KV as full blocks (every layer, every head), for a handoff between any parallel layouts -----
    @property
    def total_kv_heads(self) -> int:
        return total_kv_heads(self.model)

    @property
    def world_size(self) -> int:
        """The processes this model runs in: tensor-parallel ranks times pipeline stages."""
        return 1 if self.ranks is None else self.ranks.world_size

    @torch.inference_mode()
    def export_kv(self, block_ids: list[int]) -> torch.Tensor:
        """``[all layers, 2, n, bs, all KV heads, D]`` of ``block_ids``, gathered from every rank."""
        return driver_export(self.ranks, self.kv_cache, block_ids, self.total_kv_heads, stage_layers(self.model))

    @torch.inference_mode()
    def import_kv(self, block_ids: list[int], full: torch.Tensor) -> None:
        """Write full blocks into ``block_ids``, each rank its own stage's layers and its own heads."""
        driver_import(self.ranks, self.kv_cache, block_ids, full, stage_layers(self.model))

    @torch.inference_mode()
    def send_kv_parts(self, request_id: str, block_ids: list[int], peer: str, requester: str, epoch: int,
                      deadline_s: float, targets: list | None = None) -> int:
        """Every rank sends its own part of ``block_ids`` to ``peer``, or to the decode ranks of ``targets``
        holding it (EngineKV.send_parts); rank 0's bytes."""
        msg = RankKVSend(request_id, list(block_ids), peer, requester, deadline_s, list(targets or []), epoch)
        try:
            return driver_send(self.ranks, self.parts, self.model, self.kv_cache, msg)
        except zmq.ZMQError as exc:
            raise ValueError(f"KV parts for {peer}: {exc}") from exc

    def flush_kv_parts(self) -> bool:
        if self.ranks is not None:
            self.ranks.check()  # a dead rank's part never comes: the transfer cannot complete
        return self.parts.flush()
