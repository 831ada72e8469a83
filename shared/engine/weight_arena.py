"""One model's weights as views into one flat byte buffer (its "arena"), so that the whole model can be
shared between processes as ONE segment: a file in /dev/shm on CPU, one CUDA IPC handle on a GPU.
Which process fills the arena and which maps a filled one is decided outside the engine
(shared/worker/shared_weights.py); the loader only asks an ``ArenaSource`` for the buffer.

The model is built with its parameters on the meta device (its buffers, e.g. rotary tables, are computed
for real as usual), so a model whose weights are mapped never allocates a private copy, not even
uninitialised. Each parameter then becomes a view at a fixed, aligned offset: the layout depends only on
the model's architecture, config and dtype, and its digest is checked by the process that maps it.
"""

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from kvrelay.shared.engine.models import build_model
from kvrelay.shared.engine.quant.config import QuantConfig

ALIGN = 256  # bytes: covers every dtype and the widest vector loads of the kernels


@dataclass(frozen=True)
class ArenaSlot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the arena's start

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


class ArenaSource(Protocol):
    """Where a model's arena comes from. ``allocate`` returns a uint8 tensor of ``nbytes`` on the model's
    device; ``filled`` is then True when it already holds the weights (mapped from another process), in
    which case the loader reads no checkpoint and initialises nothing."""

    filled: bool

    def allocate(self, nbytes: int, digest: str) -> torch.Tensor:
        ...


def arena_layout(model: nn.Module) -> tuple[list[ArenaSlot], int]:
    """(each distinct parameter's slot, the arena's size in bytes). Tied parameters appear once."""
    slots, offset = [], 0
    for name, p in model.named_parameters():  # deduplicated: a tied weight is one parameter
        slot = ArenaSlot(name, p.dtype, tuple(p.shape), offset)
        slots.append(slot)
        offset += -(-slot.nbytes // ALIGN) * ALIGN
    return slots, offset


def layout_digest(slots: list[ArenaSlot]) -> str:
    text = ";".join(f"{s.name}:{s.dtype}:{list(s.shape)}:{s.offset}" for s in slots)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered in this block lands on the meta device; buffers stay where they are
    built. A parameter's construction may still allocate for a moment (one at a time, freed at once)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)  # what loading reads off it (a quantized weight's output_dim)
            param = meta
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _same_device(have: torch.device, want: torch.device) -> bool:
    """``cuda`` names the current device: equal to ``cuda:<current>``."""
    have, want = torch.device(have), torch.device(want)
    if have.type != want.type:
        return False
    if have.type != "cuda" or (have.index is not None and want.index is not None):
        return have.index == want.index
    return (have.index if have.index is not None else torch.cuda.current_device()) == \
        (want.index if want.index is not None else torch.cuda.current_device())


def build_in_arena(hf_config: dict, dtype: torch.dtype, device: torch.device, source: ArenaSource,
                   quant: QuantConfig | None = None) -> nn.Module:
    """The model on ``device`` with every parameter a view into the arena ``source`` gives (quantized
    projections' packed weights and scales included: they are parameters too)."""
    with _parameters_on_meta():
        model = build_model(hf_config, dtype, device, quant)
    slots, total = arena_layout(model)
    arena = source.allocate(total, layout_digest(slots))
    if arena.dtype != torch.uint8 or arena.numel() != total or not _same_device(arena.device, device):
        raise ValueError(f"weight arena is {arena.numel()} {arena.dtype} on {arena.device}; "
                         f"the model needs {total} uint8 on {device}")
    views = {}
    for slot in slots:
        view = arena[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
        views[slot.name] = nn.Parameter(view, requires_grad=False)
    for name, p in model.named_parameters():  # what loading reads off a parameter (e.g. its output_dim)
        views[name].__dict__.update(p.__dict__)
    by_id = {id(p): views[name] for name, p in model.named_parameters()}
    for module in model.modules():  # every module holding a (possibly tied) parameter gets the same view
        for pname, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[pname] = by_id[id(p)]
    return model
