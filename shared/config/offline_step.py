"""The offline engine's step budget where the caller gave none: vLLM's LLM-class defaults on a GPU.

A step of many prompt tokens keeps the GEMMs compute-bound and pays the step's host work once for more tokens;
a worker keeps DEFAULT_STEP_TOKENS (shared/config/engine.py) so that a prompt delays the decodes beside it less.
"""

LARGE_GPU, GPU = 16384, 8192
LARGE_GPU_BYTES = 70 << 30


def offline_batched_tokens(device: str) -> int | None:
    """The budget on ``device`` (a resolved device string) by its memory and name; None on the CPU (the
    worker default). A100s keep the smaller step, as in vLLM (a larger one lowered their throughput there)."""
    if not device.startswith("cuda"):
        return None
    import torch

    props = torch.cuda.get_device_properties(torch.device(device))
    if props.total_memory >= LARGE_GPU_BYTES and "a100" not in props.name.lower():
        return LARGE_GPU
    return GPU
