"""What one loaded model keeps in memory besides its weights and its KV, and the temporary peak of its steps:
what a worker of several models must budget per resident model and once for the step that runs (issue #26).

Resident overhead: the model's buffers (rotary tables, ALiBi slopes), the decode CUDA graphs' static input and
logits buffers and their private memory pool, the fp8 KV scales. Per model, for as long as it is loaded.
Step peak: the activations of the largest step, above what is resident. Steps of a worker's models run one at a
time (its step lock), so a worker holds one step peak back, the largest of its models', not one per model.

The tensors the engine holds are counted (CPU and CUDA alike). On CUDA the graphs' private pools are read from
the caching allocator besides: every private pool's whole segments (a captured graph's pool keeps them
reserved where the capture freed its intermediates), across the engine's build and within each warm-up shape. The
ordinary pool's growth over those spans is not taken: a worker reads another model's weights into it on
another thread meanwhile (shared/worker/model_loads.py), which would count as this model's; what that leaves
out (sampler and stepper state, library workspaces) is small and shared, the worker's allocator slack
(shared/worker/host_budget.py). The step peak is the allocator's peak within each warm-up shape above where the
shape started or ended, whichever is higher (a weight read on another thread only adds, so it stays out of the
difference); the shapes run under the worker's step lock, so no other model's step is inside. On the CPU no
allocator reports: the step peak is not measured (0: a CPU worker's budget never held steps back).
"""

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

import torch

DEFAULT_POOL = (0, 0)  # torch's id of the caching allocator's ordinary pool in a memory snapshot


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view and its base count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def persistent_bytes(runner) -> int:
    """The runner's tensors that live as long as the model, its parameters and KV aside: the model's buffers
    (those not sharing a parameter's storage), the decode graphs' static buffers, the fp8 KV scales."""
    model = runner.model
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    graphs = runner.graphs
    held = [b for b in model.buffers() if b.untyped_storage().data_ptr() not in params]
    held += [graphs.buffer, graphs.logits] if graphs is not None else []
    held.append(runner.kv_scales if isinstance(runner.kv_scales, torch.Tensor) else None)
    return storage_bytes(held)


def private_pool_bytes(device: torch.device) -> int:
    """CUDA: bytes of the caching allocator's private pools (CUDA graphs' pools) on ``device``, segments whole."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if seg.get("device", index) == index and tuple(seg.get("segment_pool_id") or DEFAULT_POOL) != DEFAULT_POOL)


class ResidentMeter:
    """Measures one engine's resident overhead and step peak; ``EngineCore`` holds one (``memory``)."""

    def __init__(self, device: torch.device):
        # without a CUDA device the runner's build refuses the config with its own one-line error; reading the
        # allocator here first would raise torch's instead
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.device = device
        self.overhead_bytes = 0
        self.step_peak_bytes = 0
        self.peak_measured = False
        self._before = self._resident()

    def _resident(self) -> int:
        return private_pool_bytes(self.device) if self.cuda else 0

    def built(self, runner) -> None:
        """After the runner's build (weights, KV attach, graph capture)."""
        self.overhead_bytes = persistent_bytes(runner) + max(0, self._resident() - self._before)

    def warming(self, hold: AbstractContextManager | None) -> "ShapePeaks":
        """The context warm-up enters around each shape (inside ``hold``, the worker's step lock)."""
        return ShapePeaks(self, hold)

    def warmed(self, peaks: "ShapePeaks") -> None:
        """After warm-up: graph memory its shapes captured joins the overhead (read inside each shape: between
        them another model's build may capture its own); its largest shape's peak is the step peak."""
        if not self.cuda:
            return
        self.overhead_bytes += peaks.captured
        self.step_peak_bytes = peaks.peak
        self.peak_measured = peaks.shapes > 0


class ShapePeaks(AbstractContextManager):
    """Entered around each warm-up shape: on CUDA the allocator's peak inside it above where it started or ended."""

    def __init__(self, meter: ResidentMeter, hold: AbstractContextManager | None):
        self.meter = meter
        self.hold = hold or nullcontext()
        self.peak = 0
        self.shapes = 0
        self.captured = 0  # private pool bytes the shapes added
        self._start = self._private = 0

    def __enter__(self):
        self.hold.__enter__()
        if self.meter.cuda:
            torch.cuda.synchronize(self.meter.device)
            torch.cuda.reset_peak_memory_stats(self.meter.device)
            self._start = torch.cuda.memory_allocated(self.meter.device)
            self._private = private_pool_bytes(self.meter.device)
        return self

    def __exit__(self, *exc):
        if self.meter.cuda and exc[0] is None:
            try:
                torch.cuda.synchronize(self.meter.device)
                end = torch.cuda.memory_allocated(self.meter.device)
                peak = torch.cuda.max_memory_allocated(self.meter.device) - max(self._start, end)
                self.peak = max(self.peak, peak)
                self.captured += max(0, private_pool_bytes(self.meter.device) - self._private)
                self.shapes += 1
            except BaseException:
                self.hold.__exit__(*exc)
                raise
        return self.hold.__exit__(*exc)

