"""Pipeline parallelism's split of a model: which contiguous decoder layers one stage holds.

Stage 0 also holds the token embedding, the last stage the final norm and the LM head (and, when the LM
head is tied to it, the embedding too). The layers another stage holds are ``MissingLayer`` placeholders,
so every layer keeps its index (checkpoint names, KV scales) while only this stage's weights exist; a
stage's KV cache holds its own layers only (its layer ``i`` is cache row ``i - start``).
"""

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class PipelineStage:
    index: int = 0
    size: int = 1
    start: int = 0
    end: int | None = None  # one past this stage's last layer; None: every layer (no pipeline)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    def layers(self, num_layers: int) -> range:
        return range(self.start, num_layers if self.end is None else self.end)

    def holds(self, layer: int) -> bool:
        return self.start <= layer and (self.end is None or layer < self.end)


WHOLE = PipelineStage()


def stage_bounds(num_layers: int, size: int) -> list[tuple[int, int]]:
    """Each stage's [start, end) layers: as even as the count allows, the first stages one layer more
    (the last stage also runs the LM head)."""
    if size < 1:
        raise ValueError(f"pipeline_parallel_size must be at least 1, got {size}")
    if size > num_layers:
        raise ValueError(f"pipeline_parallel_size {size} exceeds the model's {num_layers} layers: "
                         "a stage would hold no layers")
    base, extra = divmod(num_layers, size)
    bounds, start = [], 0
    for index in range(size):
        end = start + base + (1 if index < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def config_layers(hf_config: dict) -> int:
    """The decoder layers an HF config declares (Llama family: num_hidden_layers; GPT-2, BLOOM: n_layer)."""
    for key in ("num_hidden_layers", "n_layer"):
        if hf_config.get(key) is not None:
            return int(hf_config[key])
    raise ValueError("model config lacks num_hidden_layers / n_layer")


def make_stage(index: int, size: int, hf_config: dict) -> PipelineStage:
    """Stage ``index`` of ``size`` for the model ``hf_config`` describes (raises when a stage would be empty)."""
    if size == 1:
        return WHOLE
    start, end = stage_bounds(config_layers(hf_config), size)[index]
    return PipelineStage(index, size, start, end)


class MissingLayer(nn.Module):
    """A module another pipeline stage holds: no weights here, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module is held by another pipeline stage")


def prune(model: nn.Module, stage: PipelineStage, first_only: tuple[str, ...], last_only: tuple[str, ...]) -> None:
    """Replace the modules only the first (``first_only``) or only the last stage (``last_only``) needs
    with placeholders on the other stages. Names that are absent (an untied model's missing LM head) skip."""
    for names, keep in ((first_only, stage.first), (last_only, stage.last)):
        if keep:
            continue
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            if hasattr(parent, child):
                setattr(parent, child, MissingLayer())


def held(model: nn.Module, name: str) -> bool:
    """Whether checkpoint tensor ``name`` belongs to a module this stage holds."""
    module = model
    for part in name.split(".")[:-1]:
        module = getattr(module, part, None) if not part.isdigit() else _child(module, int(part))
        if module is None:
            return True  # not a module path: the base route decides whether the name is known
        if isinstance(module, MissingLayer):
            return False
    return True


def _child(module: nn.Module, index: int) -> nn.Module | None:
    return module[index] if isinstance(module, nn.ModuleList) and index < len(module) else None
