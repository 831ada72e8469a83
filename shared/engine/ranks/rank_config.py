"""What rank 0 hands each rank process on its stdin (shared/config/handover.py: typed JSON, validated on
arrival, never argv, never pickle): the engine's config, and the links its ranks send their parts of a
prompt's KV over (the deployment's CURVE secret), when the engine has them; a decode group's links also name
the host each rank binds its own socket on, to take its share of arriving KV (kv_inlet.py)."""

from dataclasses import dataclass

from kvrelay.shared.config.engine import EngineConfig
from kvrelay.shared.engine.kv_connector import KVLinks


@dataclass
class RankConfig:
    engine: EngineConfig
    links: KVLinks | None = None  # None: the ranks send no KV themselves (rank 0 gathers it)
    # an fp8 cache's scales, [layer][K, V] of the whole model as rank 0 read them (shared/engine/kv_scales.py)
    kv_scales: list[list[float]] | None = None
