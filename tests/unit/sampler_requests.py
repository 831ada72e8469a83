"""What the sampler's tests share: a request with the sampling parameters a test names, and the devices a
test runs on (CUDA only where there is one)."""

import pytest
import torch

from kvrelay.shared.engine.request import Request
from kvrelay.shared.wire.sampling_params import SamplingParams

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")],
    ),
]


def make_request(
    request_id: str = "r", prompt: list[int] | None = None, eos: int | None = None, **params: object
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt or [0]),
        sampling_params=SamplingParams(**params),
        eos_token_id=eos,
    )
