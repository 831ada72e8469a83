"""The offline engine: scheduler, block manager, model runner, sampler, models and their weight loader.

Its public surface is ``EngineCore`` (engine_core.py) with the KV-connector seam it exposes
(kv_connector.py), the request and output records, and the KV pool co-resident models share; nothing
outside the engine names the scheduler, the block manager or the model runner. The names load on first
use (PEP 562), so importing a torch-free module of the engine (progress bars, outputs) pays for no torch."""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvrelay.shared.engine.admission import over_tenant_quota
    from kvrelay.shared.engine.engine_core import EngineCore
    from kvrelay.shared.engine.kv_connector import EngineKV, LayerSaver, detached_kv
    from kvrelay.shared.engine.kv_pool import KVPool
    from kvrelay.shared.engine.observer import EngineObserver
    from kvrelay.shared.engine.outputs import EngineCoreOutput
    from kvrelay.shared.engine.request import Request
    from kvrelay.shared.engine.scheduler_output import SchedulerOutput

_HOMES = {
    "EngineCore": "kvrelay.shared.engine.engine_core",
    "EngineObserver": "kvrelay.shared.engine.observer",
    "EngineKV": "kvrelay.shared.engine.kv_connector",
    "LayerSaver": "kvrelay.shared.engine.kv_connector",
    "detached_kv": "kvrelay.shared.engine.kv_connector",
    "KVPool": "kvrelay.shared.engine.kv_pool",
    "EngineCoreOutput": "kvrelay.shared.engine.outputs",
    "Request": "kvrelay.shared.engine.request",
    "SchedulerOutput": "kvrelay.shared.engine.scheduler_output",  # what an EngineObserver is shown of a step
    "over_tenant_quota": "kvrelay.shared.engine.admission",  # --tenant-kv-quota's rule, for stand-ins of EngineCore
}

__all__ = ["EngineCore", "EngineObserver", "EngineKV", "LayerSaver", "detached_kv", "KVPool", "EngineCoreOutput",
           "Request", "SchedulerOutput", "over_tenant_quota"]


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvrelay.shared.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
