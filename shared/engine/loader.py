"""Weight loading: an HF directory (config.json + model.safetensors, or a sharded
model.safetensors.index.json) or dummy random weights of a preset shape, into our own model on
the target device in the target dtype.

Every safetensors header is checked against its file size before a byte is loaded, so a
truncated download fails with the file's name rather than deep inside a memory map. A model from the
repository (``root`` given) has each file resolved and confined to the repository just before it is
opened, and is opened by that resolved path (shared/repo/model_repo.py).
"""

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from kvrelay.shared.config.confined import inside, joined
from kvrelay.shared.config.engine import ModelConfig
from kvrelay.shared.config.presets import DUMMY_PREFIX, get_preset
from kvrelay.shared.engine.dummy_weights import fill_normal_
from kvrelay.shared.engine.models import build_model, get_model_class
from kvrelay.shared.engine.parallel.pipeline import make_stage
from kvrelay.shared.engine.parallel.state import SINGLE, ParallelState
from kvrelay.shared.engine.quant import config as quant_config
from kvrelay.shared.engine.quant.config import QuantConfig
from kvrelay.shared.engine.quant.linear import QuantLinear
from kvrelay.shared.engine.weight_arena import ArenaSource, build_in_arena
from kvrelay.shared.repo.model_shape import max_model_len
from kvrelay.shared.text.progress import progress_bar

DUMMY_INIT_STD = 0.02  # small enough that logits of a many-layer random model stay finite in bf16


def load_model(model_config: ModelConfig, device: str | torch.device, progress: bool = True,
               root: Path | None = None, arena: ArenaSource | None = None,
               parallel: ParallelState = SINGLE, pipeline: tuple[int, int] = (0, 1)) -> tuple[nn.Module, dict]:
    """(model in eval mode on ``device`` in the resolved dtype, the HF config dict). ``root``: the model
    repository the model's files must resolve inside. ``arena``: the weights live in one shared buffer
    (shared/engine/weight_arena.py); one already filled by another process is used as it is.
    ``parallel``: load this rank's shard only, each tensor cut as it is read (shared/engine/parallel/).
    ``pipeline``: (stage, stages): load that pipeline stage's layers only."""
    device = torch.device(device)
    dtype = model_config.torch_dtype(device.type)
    dummy = model_config.load_format == "dummy" or model_config.model.startswith(DUMMY_PREFIX)
    if model_config.load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"load_format must be auto, safetensors or dummy; got {model_config.load_format!r}")
    if model_config.model.startswith(DUMMY_PREFIX):
        hf_config = get_preset(model_config.model[len(DUMMY_PREFIX):])
    else:
        hf_config = read_hf_config(Path(model_config.model), root)
    limit = max_model_len(hf_config)
    wanted = model_config.max_model_len
    if wanted is not None and wanted > limit and get_model_class(hf_config).has_position_limit:
        raise ValueError(f"max_model_len {wanted} exceeds what {model_config.model} serves exactly "
                         f"({limit} tokens: its position limit, or its sliding attention window)")

    quant = quant_config.resolve(model_config.quantization, hf_config, device, dummy)
    stage = make_stage(*pipeline, hf_config)
    if (parallel.world_size > 1 or stage.size > 1) and arena is not None:
        raise ValueError("tensor_parallel_size > 1 loads unshared weights only (not from a shared weight arena)")
    if parallel.world_size > 1 and quant is not None:
        check_split_quantization(quant, parallel.world_size)
    # built directly on the device in the dtype: no fp32 staging copy, no default-init pass
    if arena is None:
        model = build_model(hf_config, dtype, device, quant, parallel, stage)
    else:
        model = build_in_arena(hf_config, dtype, device, arena, quant)
    mapped = arena is not None and arena.filled
    if mapped:
        pass  # the process that filled it loaded these exact weights
    elif dummy:
        init_dummy_weights(model, model_config.seed)
    else:
        files = safetensors_files(Path(model_config.model), root)
        model.load_weights(iter_safetensors(files, progress))
    finish_loading(model, mapped)
    model.eval().requires_grad_(False)
    return model, hf_config


def finish_loading(model: nn.Module, mapped: bool) -> None:
    """Each module's optional ``finish_loading(mapped)``, once every weight is in: a step that needs
    several tensors which may arrive in any order (GPTQ act-order's row sort). It runs in the process that
    fills a shared arena before the arena is offered to others, so what it writes there is shared; a
    process that maps the arena (``mapped``) must write nothing to it, only derive its private state."""
    for module in model.modules():
        hook = getattr(module, "finish_loading", None)
        if callable(hook):
            hook(mapped)


def check_split_quantization(quant: QuantConfig, world_size: int) -> None:
    """Every quantization splits across tensor-parallel ranks (shared/engine/quant/linear.py) but GPTQ's
    act-order: a row-parallel rank's inputs would read groups scattered over every rank's share of the
    scales. One line naming both settings."""
    if quant.desc_act:
        raise ValueError(f"quantization {quant.method} with act-order (desc_act) does not support "
                         f"tensor_parallel_size {world_size}: use a checkpoint without desc_act, or "
                         "pipeline_parallel_size")


def model_file(model_dir: Path, name: str, root: Path | None = None) -> Path:
    """``model_dir/name``; for a repository model (``root``) resolved, and refused unless inside ``root``."""
    if root is None:
        return model_dir / name
    # a repository version is <root>/<name>/<version>: named as the repository names it
    return inside(root, joined(model_dir, name), f"{model_dir.parent.name} v{model_dir.name}: {name}")


def read_hf_config(model_dir: Path, root: Path | None = None) -> dict:
    path = model_file(model_dir, "config.json", root)
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} is not a model directory: no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights, a pure function of (seed, parameter name, shape, dtype): the same on every device
    and share of one (shared/engine/dummy_weights.py; an int8/fp8 projection's scales may differ in the
    last place between CPU and CUDA, whose scalar division multiplies by the reciprocal). Matrices
    ~N(0, 0.02) (bell-shaped, bounded), norm scales 1, biases 0. A tensor-parallel rank draws its shard
    as a tensor of its own under the whole parameter's name (so every rank holds the same values, not a
    slice of the unsharded model's); a pipeline stage's layers keep the whole model's names, so they hold
    the whole model's values.

    Filled in place in the parameter's own dtype, a chunk at a time: little is allocated beyond the model."""
    done: set[int] = set()
    for prefix, module in model.named_modules():  # quantized projections draw a dense weight and quantize it
        if isinstance(module, QuantLinear):
            module.init_dummy(seed, prefix)
            done.update(id(p) for name, p in module.named_parameters() if name != "bias")
    for name, param in model.named_parameters():
        if id(param) in done:
            continue
        if param.dim() == 1:
            param.fill_(1.0 if name.endswith("weight") else 0.0)
        else:
            fill_normal_(param, seed, name, DUMMY_INIT_STD)


def safetensors_files(model_dir: Path, root: Path | None = None) -> list[Path]:
    """The checkpoint's files, after checking that the index (if sharded) and the files agree."""
    index_path = model_file(model_dir, "model.safetensors.index.json", root)
    single = model_file(model_dir, "model.safetensors", root)
    if index_path.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index_path} is not a valid safetensors index: {e}") from e
        names = sorted(set(weight_map.values()))
        files = [model_file(model_dir, name, root) for name in names]
        headers = {}
        for name, file in zip(names, files, strict=True):
            if not file.is_file():
                raise FileNotFoundError(f"shard {name} named in {index_path.name} is missing from {model_dir}")
            headers[name] = read_safetensors_header(file)
        for tensor, file_name in weight_map.items():
            if tensor not in headers[file_name]:
                raise ValueError(f"tensor {tensor!r} is listed in {index_path.name} under {file_name}, "
                                 f"but that shard does not contain it")
        return files
    if single.is_file():
        read_safetensors_header(single)
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir} "
                            "(PyTorch .bin checkpoints are refused: they are pickle)")


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """Tensor name -> {dtype, shape, data_offsets}; raises if the file is shorter than it claims."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path} is not a safetensors file (only {size} bytes; truncated?)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > size - 8:
            raise ValueError(f"{path} is truncated or corrupt: header claims {header_len} bytes, "
                             f"file has {size - 8} after the length prefix")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} has a corrupt safetensors header: {e}") from e
    header.pop("__metadata__", None)
    data_size = size - 8 - header_len
    for name, info in header.items():
        end = info.get("data_offsets", [0, 0])[1]
        if end > data_size:
            raise ValueError(f"{path} is truncated: tensor {name!r} ends at byte {end} of the data section, "
                             f"which holds only {data_size} bytes")
    return header


def iter_safetensors(files: list[Path], progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of every file, with a progress bar over tensors."""
    total = sum(len(read_safetensors_header(f)) for f in files)
    with progress_bar("Loading weights", total=total, unit="tensor", disable=not progress) as bar:
        for file in files:
            bar.set_postfix_str(file.name)
            try:
                with safe_open(str(file), framework="pt", device="cpu") as reader:
                    for name in reader.keys():
                        yield name, reader.get_tensor(name)
                        bar.update(1)
            except SafetensorError as e:
                raise ValueError(f"cannot read {file}: {e} (truncated or corrupt checkpoint?)") from e
