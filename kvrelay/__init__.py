"""kvrelay's public face: the offline API and the ``kvrelay`` CLI. No logic lives here.

The offline API's names load on first use (PEP 562): ``kvrelay.gateway`` is a subpackage of this package
and must not pay for torch, which ``LLM`` needs."""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvrelay.llm import LLM
    from kvrelay.shared.engine.outputs import CompletionOutput, RequestOutput
    from kvrelay.shared.wire.sampling_params import SamplingParams

_HOMES = {
    "LLM": "kvrelay.llm",
    "SamplingParams": "kvrelay.shared.wire.sampling_params",
    "RequestOutput": "kvrelay.shared.engine.outputs",
    "CompletionOutput": "kvrelay.shared.engine.outputs",
}

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvrelay' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
