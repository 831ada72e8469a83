"""Warm-up (shared/engine/warmup.py) that measures, shape by shape, the model's step peak and what its steps
leave resident (shared/engine/resident_memory.py): what a worker of several models budgets for it."""

from contextlib import AbstractContextManager

from kvrelay.shared.engine.engine_core import EngineCore
from kvrelay.shared.engine.warmup import warm_up


def warm_up_measured(core: EngineCore, decode: bool = True, compiles: bool = True,
                     hold: AbstractContextManager | None = None) -> int:
    """``warm_up``, each shape entered through the meter's context (inside ``hold``); how many shapes ran."""
    peaks = core.memory.warming(hold)
    ran = warm_up(core, decode=decode, compiles=compiles, hold=peaks)
    core.memory.warmed(peaks)
    return ran
