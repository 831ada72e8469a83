"""Host -> GPU weight copies that leave the serving models alone.

A model loads while co-resident models keep serving (shared/worker/model_host.py). A plain ``param.copy_(cpu)``
goes through the legacy default stream the engines run on, from pageable memory, so every copy waits
for the queued decode steps and every step waits behind the copy. Here each tensor is staged into a
pinned buffer and copied on a side stream; at most ``window`` copies are in flight, which bounds the
pinned memory to a few tensors (the caching host allocator reuses the buffers).
"""

from collections import deque

import torch


class WeightUploader:
    def __init__(self, device: torch.device, window: int = 4):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.window = window
        self.pending: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()
        if self.stream is not None:
            # parameters were just allocated (maybe initialised) on the current stream
            self.stream.wait_stream(torch.cuda.current_stream(device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.stream is None or dst.device.type != "cuda" or src.device.type != "cpu":
            dst.copy_(src)
            return
        if len(self.pending) >= self.window:
            event, _ = self.pending.popleft()
            event.synchronize()  # its pinned buffer goes back to the allocator's cache
        staged = src.pin_memory()
        with torch.cuda.stream(self.stream):
            dst.copy_(staged, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.pending.append((event, staged))

    def finish(self) -> None:
        """Every copy landed; the current stream may use the weights."""
        if self.stream is not None:
            self.stream.synchronize()
            self.pending.clear()
