"""The one seam between the engine and KV transfer (after vLLM V1's KVConnector): nothing outside the
engine touches its block manager, scheduler or runner; a KV connector (shared/handoff) works on a
model's KV through ``EngineCore.kv`` and is called back by the forward through a ``LayerSaver``.

Scheduler side (which blocks hold what):
  - ``reserve``: a request whose KV is computed elsewhere gets its blocks before the KV arrives (the
    decode side pre-allocates, the prefill side writes); ``EngineCore.add_remote_prefilled`` admits it
    once the KV landed; ``free`` gives back a reservation whose KV never came; ``park`` keeps one out
    of use under another owner key while a peer may still write it. ``reserve_prefix`` reuses the leading
    blocks the prefix cache already holds (vLLM's decode-side ``get_num_new_matched_tokens``), so only the
    rest arrives; ``holds_prefix`` checks them against the prompt before it is admitted.
  - A finished request's KV outlives it while a transfer reads it (``EngineCore(hold_finished_kv=True)``,
    vLLM's ``request_finished`` answering "hold"); ``release_held`` frees it once handed off.
Worker side (where the KV is):
  - ``kv_cache``, ``block_size``, ``block_ids``: what a transfer reads or writes.
  - ``set_layer_saver``: the forward reports each decoder layer written (vLLM's ``save_kv_layer``), so
    the KV of the prompts it finishes can leave while later layers compute.
  - ``sharded``: the KV is split over the processes of a tensor-parallel group (its heads) or a pipeline
    (its layers), and ``kv_cache`` holds rank 0's share alone. Leaving, each rank sends its own part to
    the decode worker (``send_parts``, shared/engine/ranks/kv_parts.py) when the engine was given the
    ``KVLinks`` its ranks dial with (so does an engine of one process, to a decode worker whose ranks each
    take their own share: ``sends_parts_to``); arriving, each rank takes its own share on its own socket when the links
    name an ``inlet_host`` (``part_targets``, shared/engine/ranks/kv_inlet.py), else the KV is imported as full
    blocks of every layer and head (``import_blocks``, every layer at once, between steps). ``export_blocks`` (a gather to rank 0) is what
    a sharded sender without links, and a reader of a whole copy, use. Never layer by layer.
"""

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import zmq

from kvrelay.shared.engine.block_manager import BlockManager
from kvrelay.shared.wire.zmq_auth import CurveKeys


@dataclass(frozen=True)
class KVLinks:
    """What a tensor- or pipeline-parallel engine's ranks need to send their parts of the KV to decode workers
    themselves: the deployment's CURVE secret (Z85; None under --insecure-zmq). Handed to each rank with its
    config on stdin (shared/engine/ranks/rank_config.py), never argv."""

    secret: str | None = None
    # a decode worker's: each rank binds a socket of its own on this host and takes its own share of handed-off
    # KV there (shared/engine/ranks/kv_inlet.py); None: the KV arrives through rank 0
    inlet_host: str | None = None
    inlet_advertise: str | None = None  # the address peers dial for it (default: ``inlet_host``)

    @classmethod
    def of(cls, keys: CurveKeys | None, inlet_host: str | None = None,
           inlet_advertise: str | None = None) -> "KVLinks":
        return cls(None if keys is None else keys.secret.decode(), inlet_host, inlet_advertise)

    def keys(self) -> CurveKeys | None:
        if self.secret is None:
            return None
        secret = self.secret.encode()
        return CurveKeys(public=zmq.curve_public(secret), secret=secret)

    def __repr__(self) -> str:  # a config or exception printing its holder never shows the secret
        return f"KVLinks(curve={self.secret is not None}, inlet_host={self.inlet_host!r})"


class LayerSaver(Protocol):
    """What the forward calls, implemented by the connector (shared/handoff/layer_stream.py ``LayerStream``)."""

    def begin(self, finishing: list[tuple[str, list[int]]]) -> bool:
        """Before an eager forward that computes the last prompt chunk of ``finishing`` (request id, its
        block ids): True when any of their layers is worth reporting."""

    def layer_done(self, layer: int) -> None:
        """Decoder layer ``layer`` of this forward has written its KV (queued on the compute stream)."""

    def end(self) -> None:
        """The forward is queued: whatever no ``layer_done`` reported is written too."""


class EngineKV:
    """One model's KV blocks as a KV connector sees them."""

    def __init__(self, block_manager: BlockManager, kv_cache: Callable[[], torch.Tensor],
                 release_held: Callable[[str], None], set_layer_saver: Callable[[LayerSaver | None], None],
                 world_size: int = 1, num_kv_heads: int | None = None, num_layers: int | None = None,
                 export: Callable[[list[int]], torch.Tensor] | None = None,
                 import_: Callable[[list[int], torch.Tensor], None] | None = None,
                 send_parts: Callable[..., int] | None = None,
                 flush_parts: Callable[[], bool] | None = None, inlets=None, scales_digest: str = ""):
        """``world_size``: the model's processes (tensor-parallel ranks x pipeline stages);
        ``num_kv_heads`` / ``num_layers``: the model's, over every rank (default: the cache's); ``export`` /
        ``import_``: full blocks out of / into every rank's cache (needed when ``world_size`` > 1);
        ``send_parts`` / ``flush_parts``: every rank sends its own part (``send_parts`` below); ``inlets``:
        every rank takes its own share of arriving KV (shared/engine/ranks/kv_inlet.py ``InletDriver``);
        ``scales_digest``: of an fp8 cache's per-layer scales ("" for another dtype, shared/engine/kv_scales.py),
        which a peer's must equal for its blocks to mean the same here."""
        self._blocks = block_manager
        self._kv_cache = kv_cache
        self._release_held = release_held
        self._set_layer_saver = set_layer_saver
        self.sharded = world_size > 1
        self._num_kv_heads, self._num_layers = num_kv_heads, num_layers
        self._export, self._import = export, import_
        self._send_parts, self._flush_parts = send_parts, flush_parts
        self._inlets = inlets
        self.scales_digest = scales_digest

    # -- scheduler side ---------------------------------------------------------------------------
    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Blocks for the KV of ``num_tokens`` tokens computed elsewhere, or None when too few are free."""
        return self._blocks.allocate_for_tokens(request_id, num_tokens)

    @property
    def reuses_prefix(self) -> bool:
        """Whether ``reserve_prefix`` may reuse cached blocks: prefix caching on, one process holding the whole
        KV (a sharded cache's ranks would each have to hold the same blocks, which nothing checks)."""
        return self._blocks.enable_prefix_caching and not self.sharded

    def reserve_prefix(self, request_id: str, num_tokens: int,
                       block_hashes: list[int]) -> tuple[list[int], int] | None:
        """``reserve``, reusing the longest run of ``block_hashes`` cached here (when ``reuses_prefix``): (the
        request's blocks, how many lead reused), or None when too few are free. The reused blocks are matched by
        hash only until ``holds_prefix`` has compared them with the prompt's tokens."""
        return self._blocks.allocate_with_prefix(request_id, num_tokens,
                                                 block_hashes if self.reuses_prefix else [])

    def cached_prefix(self, num_tokens: int, block_hashes: list[int]) -> int:
        """How many leading blocks ``reserve_prefix`` would reuse now (0 unless ``reuses_prefix``); takes nothing."""
        return self._blocks.cached_prefix(num_tokens, block_hashes) if self.reuses_prefix else 0

    def prompt_hashes(self, request_id: str) -> list[int]:
        """The hash chain of ``request_id``'s blocks as far as this engine's prefix cache has hashed them (empty
        with prefix caching off): a prefill side's offer to the decode worker without hashing the prompt again."""
        return list(self._blocks.req_hashes.get(request_id, ()))

    def holds_prefix(self, blocks: list[int], tokens: list[int], tenant: str, cache_salt: str | None) -> bool:
        """Whether ``blocks`` are cached here as the leading full blocks of ``tokens`` (tenant, salt)."""
        return self._blocks.holds_prefix(blocks, tokens, tenant, cache_salt)

    def free(self, request_id: str) -> None:
        """Give back the blocks reserved under ``request_id`` (or ``park``'s key)."""
        self._blocks.free(request_id)

    def park(self, request_id: str, key: str) -> None:
        """Move ``request_id``'s reserved blocks under the owner ``key``, out of use until ``free(key)``,
        so the request id may be reserved again at once."""
        self._blocks.reassign(request_id, key)

    def release_held(self, request_id: str) -> None:
        """A finished request's held KV has been handed off (or is no longer wanted): free its blocks."""
        self._release_held(request_id)

    # -- worker side ------------------------------------------------------------------------------
    @property
    def kv_cache(self) -> torch.Tensor:
        return self._kv_cache()

    @property
    def block_size(self) -> int:
        return self._blocks.block_size

    def block_ids(self, request_id: str) -> list[int]:
        return self._blocks.block_ids(request_id)

    @property
    def num_free_blocks(self) -> int:
        return self._blocks.num_free_blocks

    def set_layer_saver(self, saver: LayerSaver | None) -> None:
        self._set_layer_saver(saver)

    @property
    def num_kv_heads(self) -> int:
        """All of the model's KV heads: what a block carries on the wire, however the ranks split them."""
        return self._num_kv_heads or self.kv_cache.shape[4]

    @property
    def num_layers(self) -> int:
        """All of the model's layers: what a block carries on the wire, however many stages hold them."""
        return self._num_layers or self.kv_cache.shape[0]

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of ``block_ids`` with every layer and KV head: ``[num_layers, 2, len(block_ids), bs,
        num_kv_heads, D]``, on rank 0's device. Call between steps (it is a collective of the group)."""
        if self._export is None:
            return self.kv_cache[:, :, block_ids]
        return self._export(block_ids)

    @property
    def sends_by_rank(self) -> bool:
        """Sharded, and each rank can send its own part of the KV (``send_parts``)."""
        return self.sharded and self._send_parts is not None

    def sends_parts_to(self, targets: list) -> bool:
        """The KV leaves as parts (``send_parts``): a sharded engine's always, each rank its own; one
        process's when the grant names the decode worker's ranks (``targets``): its whole KV split among them."""
        return self._send_parts is not None and (self.sharded or bool(targets))

    def send_parts(self, request_id: str, block_ids: list[int], peer: str, requester: str, epoch: int,
                   deadline_s: float, targets: list | None = None) -> int:
        """Every rank sends its part of ``block_ids`` (its layers, its KV heads) to the decode worker at
        ``peer`` as KVLayers parts of ``request_id`` naming ``requester`` and the grant's ``epoch`` or, given
        the grant's ``targets`` (``KVTarget``), each decode rank its share at its own address; returns rank 0's
        part's bytes. Each rank has copied its part out before the next step, so the blocks may be released
        at once. Call between steps; raises when a rank is gone."""
        return self._send_parts(request_id, block_ids, peer, requester, epoch, deadline_s, targets)

    def flush_parts(self) -> bool:
        """Rank 0 queues what is left of its parts; True once nothing waits. Raises when a rank is gone (its
        part may never arrive)."""
        return self._flush_parts()

    # -- arriving at a sharded receiver's ranks, each its own share ----------------------------------
    def part_targets(self, request_id: str, requester: str, epoch: int, block_ids: list[int]) -> list:
        """A grant's ``KVTarget``s when every rank takes its own share of the KV (its layers, its heads): each
        rank is told to expect the parts of ``request_id``'s grant ``epoch`` into ``block_ids``; empty (the KV
        comes to rank 0 and is imported) otherwise. Rank 0's target has no address: the grant's socket."""
        return [] if self._inlets is None else self._inlets.targets(request_id, requester, epoch, block_ids)

    def receives_by_rank(self, request_id: str) -> bool:
        """Its ranks were told to expect ``request_id`` (``part_targets``) and are still at it."""
        return self._inlets is not None and self._inlets.expects(request_id)

    def ranks_received(self, request_id: str) -> tuple[bool, str, bool]:
        """(every other rank has its share of ``request_id`` in, CRC-checked; why one failed, or ""; whether
        the group is down)."""
        return self._inlets.state(request_id)

    @property
    def rank_reports(self) -> zmq.Socket | None:
        """The socket the ranks report their shares on (``ranks_received`` reads it): a loop waiting for a
        transfer to complete waits on it too. None when the KV arrives through rank 0."""
        return None if self._inlets is None else self._inlets.reports

    def drop_parts(self, request_id: str, done: bool = False) -> None:
        """The ranks forget ``request_id`` (told unless ``done``: each dropped it when it reported)."""
        if self._inlets is not None:
            self._inlets.forget(request_id) if done else self._inlets.drop(request_id)

    @property
    def rank_bytes_received(self) -> dict[int, int]:
        """KV bytes each rank 1..N-1 took on its own socket."""
        return {} if self._inlets is None else dict(self._inlets.bytes_by_rank)

    def import_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write full ``blocks`` (``export_blocks``'s shape) into ``block_ids``, each rank its layers and heads."""
        if self._import is None:
            self.kv_cache[:, :, block_ids] = blocks.to(self.kv_cache.device)
            return
        self._import(block_ids, blocks)


def detached_kv(kv_cache: torch.Tensor, scatter_seed: int | None = None, prefix_caching: bool = False) -> EngineKV:
    """A KV cache and its blocks without a model (the handoff's benchmark and tests): every block is a
    held prefill block or a reservation. ``scatter_seed``: hand out blocks in a shuffled order, as the
    free list of a long-running worker does. ``prefix_caching``: a reservation may reuse cached blocks
    (what a decode worker's engine registered; here whoever drives the block manager)."""
    num_blocks, block_size = kv_cache.shape[2], kv_cache.shape[3]
    blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    if scatter_seed is not None:
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(scatter_seed)).tolist()
        blocks.free_queue = OrderedDict.fromkeys(order)

    def no_forward(saver: LayerSaver | None) -> None:
        raise RuntimeError("a KV cache without a model runs no forward to save layers from")

    return EngineKV(blocks, lambda: kv_cache, blocks.free, no_forward)


def engine_kv(runner, block_manager: BlockManager, release_held: Callable[[str], None]) -> EngineKV:
    """An engine core's EngineKV: the KV its model runner (shared/engine/model_runner.py) holds in the blocks
    ``block_manager`` lends, ``release_held`` its scheduler's. A runner of a split model also moves whole
    blocks through its ranks (export/import); given ``KVLinks`` its ranks send their own parts
    (``runner.parts``) and, a decode worker's, take their own shares of arriving KV (``runner.inlets``)."""
    parts = {} if runner.parts is None else dict(send_parts=runner.send_kv_parts, flush_parts=runner.flush_kv_parts)
    return EngineKV(block_manager, lambda: runner.kv_cache, release_held, runner.set_kv_stream,
                    world_size=runner.world_size, num_kv_heads=runner.total_kv_heads,
                    num_layers=runner.model.num_layers, export=runner.export_kv, import_=runner.import_kv,
                    **parts, inlets=runner.inlets, scales_digest=runner.kv_scales_digest)
