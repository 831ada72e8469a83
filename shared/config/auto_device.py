"""What ``--device auto`` means on this machine: CUDA where torch sees a device, else the CPU."""

import importlib.metadata


def auto_device() -> str:
    # A CPU build of torch (its wheel's local version "+cpu") sees no GPU: said without importing torch, which
    # costs seconds of CPU; kvrelay serve resolves the device for every child before it starts any.
    try:
        if importlib.metadata.version("torch").endswith("+cpu"):
            return "cpu"
    except importlib.metadata.PackageNotFoundError:
        pass
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
