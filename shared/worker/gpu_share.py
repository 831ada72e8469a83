"""How a worker's kernels share one GPU with the other role's process on it (``--gpu-share``).

* ``auto``: what ``kvrelay serve`` resolves before it starts the workers (kvrelay/serve_plan.py); a worker
  started on its own, with no launcher to run an MPS daemon for it, computes as under ``timeslice``.
* ``timeslice``: each process computes on its default stream; the driver alternates the two contexts.
* ``priority``: the decode worker computes on a CUDA stream of the highest priority, the prefill worker on one
  of the lowest, so a decode step's kernels are scheduled ahead of a prefill chunk's waiting ones. Priorities
  order streams of one context; across processes they only act where the contexts' work runs at once (MPS).
* ``mps``: both processes are clients of one CUDA MPS server (kvrelay/mps_daemon.py), so their kernels run at
  the same time, each limited to ``--gpu-sm-percent`` of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, read when
  the process creates its context: set here before anything touches the device).
* ``mps-priority``: both; under MPS the two processes' work shares one server context, so there the streams'
  priorities order the two roles' kernels against each other.
* ``green``: the worker computes on the stream of a CUDA green context holding ``--gpu-sm-percent`` of the SMs.

The compute stream is made current on the worker's main loop (steps, warm-up, CUDA graph capture and replay:
a graph replays on the stream it is launched on) and on a model load's thread; everything that orders work
against "the compute stream" (the handoff's copy streams) asks torch for the current one, so it follows.
"""

import os
from typing import TYPE_CHECKING

from kvrelay.shared.config.declare import ConfigError
from kvrelay.shared.config.worker import WorkerConfig

if TYPE_CHECKING:  # kvrelay serve checks configs with this module and imports no torch for it
    import torch

FLAG = "argument --gpu-share"
PRIORITY_MODES = ("priority", "mps-priority")
MPS_MODES = ("mps", "mps-priority")
MPS_SHARE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
# CUDA maps a priority beyond its range to the nearest end: 0 is the lowest (every default stream's),
# a large negative number the highest the device has
PRIORITY = {"decode": -(1 << 20), "prefill": 0}
# SMs a green context takes come in groups: 8 on Hopper (cuDevSmResourceSplitByCount's granularity)
GREEN_SM_GRANULE = 8

_compute: "list[torch.cuda.Stream]" = []  # this process's compute stream, once set up
_keep: list[object] = []  # the green context its stream belongs to lives as long as the process


def check(config: WorkerConfig) -> None:
    """A mode this worker cannot run is one line naming the flag, before anything loads; never a fallback."""
    mode = config.gpu_share
    if mode in ("auto", "timeslice"):
        return
    if not config.engine.device.startswith("cuda"):
        raise ConfigError(f"{FLAG}: {mode} needs a CUDA device (--device {config.engine.device}); on the CPU only "
                          "timeslice")
    if config.role == "unified" and mode in PRIORITY_MODES:
        raise ConfigError(f"{FLAG}: {mode} orders a prefill worker's stream below a decode worker's; a unified "
                          "worker is both")
    if config.engine.tensor_parallel_size * config.engine.pipeline_parallel_size > 1:
        raise ConfigError(f"{FLAG}: {mode} is for one process per role; --tensor-parallel-size and "
                          "--pipeline-parallel-size must be 1")
    if mode == "green" and not green_supported():
        raise ConfigError(f"{FLAG}: green needs CUDA green contexts (torch >= 2.9 built with CUDA >= 12.8, driver "
                          ">= 570); this torch has none")


def child_env(config: WorkerConfig) -> dict[str, str]:
    """What a launcher sets in this worker's environment (the MPS daemon's folders come from the launcher)."""
    return {MPS_SHARE_ENV: str(config.gpu_sm_percent)} if config.gpu_share in MPS_MODES else {}


def green_supported() -> bool:
    import torch

    green = getattr(torch.cuda, "green_contexts", None)
    return bool(green is not None and green.SUPPORTED)


def setup(config: WorkerConfig) -> None:
    """Once per worker process, before its models load: MPS's share into the environment, the compute stream
    made, and made current on the calling (main) thread."""
    import torch

    os.environ.update(child_env(config))
    stream = compute_stream(config.gpu_share, config.role, torch.device(config.engine.device), config.gpu_sm_percent)
    _compute[:] = [stream] if stream is not None else []
    enter()


def enter() -> None:
    """Makes the compute stream current on this thread (torch's current stream is per thread)."""
    if _compute:
        import torch

        torch.cuda.set_stream(_compute[0])


def compute_stream(mode: str, role: str, device: "torch.device", sm_percent: int) -> "torch.cuda.Stream | None":
    """The stream the worker computes on under ``mode``; None: the device's default stream."""
    import torch

    if mode in PRIORITY_MODES:
        return torch.cuda.Stream(device, priority=PRIORITY["decode" if role == "decode" else "prefill"])
    if mode == "green":
        index = device.index if device.index is not None else torch.cuda.current_device()
        ctx = torch.cuda.green_contexts.GreenContext.create(num_sms=green_sms(index, sm_percent), device_id=index)
        _keep.append(ctx)
        return ctx.Stream()
    return None


def green_sms(index: int, sm_percent: int) -> int:
    import torch

    total = torch.cuda.get_device_properties(index).multi_processor_count
    granules = max(1, total * sm_percent // 100 // GREEN_SM_GRANULE)
    return min(total, granules * GREEN_SM_GRANULE)
