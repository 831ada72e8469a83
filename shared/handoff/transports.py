"""The transports a worker uses unless told otherwise, in order of preference."""

from kvrelay.shared.handoff.base import Transport
from kvrelay.shared.handoff.cuda_ipc import cuda_ipc
from kvrelay.shared.handoff.frames import Frames


def default_transports() -> list[Transport]:
    """Direct writes through CUDA IPC where both sides share a GPU, frames everywhere else."""
    return [cuda_ipc(), Frames()]
