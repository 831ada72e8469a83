"""kvrelay's public face: the offline API and the ``kvrelay`` CLI. No logic lives here."""

from kvrelay.llm import LLM
from shared.outputs import CompletionOutput, RequestOutput
from shared.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
