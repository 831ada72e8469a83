"""kvrelay's public face: the offline API and the ``kvrelay`` CLI. No logic lives here."""

from kvrelay.llm import LLM
from kvrelay.shared.engine.outputs import CompletionOutput, RequestOutput
from kvrelay.shared.wire.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
