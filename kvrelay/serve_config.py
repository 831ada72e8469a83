"""``kvrelay serve --config FILE``: the models to serve and where they come from, in YAML.

    model_repo: {type: local, path: ./model_repo, versioning: numbered}
    models:
      - {name: smollm2, version: 1, device: auto, precision: auto, pinned: true}   # from the repository
      - {name: tiny, path: /models/tiny-hf-dir, precision: float32}  # an HF dir or .gguf, as --model takes
      - {name: big, version: 2, load: lazy, keep_alive_s: 600}  # registered; loaded on its first request

Per model, optional: ``device`` (auto, the default: the workers' ``--device``; any other value must be that
device, on which every model of a worker runs), ``tensor_parallel_size`` / ``pipeline_parallel_size`` (this
model's own rank group; default: the workers' flags), ``pipeline_batch_queue`` (this model's own
``--pipeline-batch-queue``, only for a model of pipeline size 2 or more; default: the flag's, which takes every
model that has a pipeline), ``calculate_kv_scales`` (this model's own ``--calculate-kv-scales``, only for a
model whose KV cache is fp8; default: the flag's, which takes every such model), ``pinned`` (never evicted), ``min_replicas``,
``keep_alive_s`` (unload after that long idle), ``load`` (``startup``, the default, or ``lazy``: registered only, loaded on first request;
lazy models must come from the repository). Keys are checked strictly: an unknown key or a value of the
wrong type (``pinned: "no"``, ``version: 2.7``) is an error naming the file and key, never a default.
A relative ``path`` (of the repository or of a model) is taken from the file's folder, so the file means
the same from any working directory; a path that is not there is an error naming the path checked.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvrelay.shared.config.declare import ConfigError, Device, DType
from kvrelay.shared.repo.model_repo import ModelRepository, RepositoryError
from kvrelay.shared.repo.model_source import DEFAULT_MODEL

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class RepositorySection(BaseModel):
    model_config = STRICT
    type: Literal["local"] = "local"
    path: str = "model_repo"
    versioning: Literal["numbered"] = "numbered"


class ModelEntry(BaseModel):
    model_config = STRICT
    name: str = Field(min_length=1)
    version: int | None = Field(None, ge=1)  # from the repository (default: its latest)
    path: str | None = Field(None, min_length=1)  # an HF directory, a .gguf file or dummy:<preset>
    device: Device = "auto"
    precision: DType = "auto"
    quantization: Literal["fp8", "int8", "awq", "gptq"] | None = None  # None: --quantization, else the checkpoint's
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] | None = None  # None: --kv-cache-dtype
    # None: --tensor-parallel-size / --pipeline-parallel-size; each model is its own group of ranks
    tensor_parallel_size: int | None = Field(None, ge=1)
    pipeline_parallel_size: int | None = Field(None, ge=1)
    pipeline_batch_queue: bool | None = None  # None: --pipeline-batch-queue, where the model has a pipeline
    calculate_kv_scales: bool | None = None  # None: --calculate-kv-scales, where the model's KV is fp8
    pinned: bool = False
    min_replicas: int = Field(0, ge=0)
    keep_alive_s: float = Field(0.0, ge=0)
    load: Literal["startup", "lazy"] = "startup"


class ServeFile(BaseModel):
    model_config = STRICT
    model_repo: RepositorySection | None = None
    models: list[ModelEntry] = Field(min_length=1)


class RepositoryConfigError(ConfigError, RepositoryError):
    """A model the file names that the repository does not hold."""


@dataclass
class ServedModel:
    name: str
    path: str  # what --model receives
    device: str = "auto"
    dtype: str = "auto"
    quantization: str = ""  # "": the worker's --quantization, else the checkpoint's own
    kv_cache_dtype: str = ""  # "": the worker's --kv-cache-dtype
    tensor_parallel_size: int = 0  # 0: the worker's --tensor-parallel-size
    pipeline_parallel_size: int = 0  # 0: the worker's --pipeline-parallel-size
    pipeline_batch_queue: bool | None = None  # None: the worker's --pipeline-batch-queue
    calculate_kv_scales: bool | None = None  # None: the worker's --calculate-kv-scales
    version: int = 0  # from the repository; 0 for a path
    pinned: bool = False
    min_replicas: int = 0
    keep_alive_s: float = 0.0
    lazy: bool = False


def load_serve_config(file: str | Path) -> tuple[ModelRepository | None, list[ServedModel]]:
    spec = _parse(file)
    folder = Path(file).absolute().parent
    names = [entry.name for entry in spec.models]
    if len(set(names)) != len(names):
        raise ConfigError(f"{file}: models: names must be unique")
    repo = None
    if spec.model_repo is not None:
        root = folder / Path(spec.model_repo.path).expanduser()
        if not root.is_dir():
            raise ConfigError(f"{file}: model_repo.path: no directory {root}{_relative_note(spec.model_repo.path)}")
        repo = ModelRepository(root)
    models = []
    for i, entry in enumerate(spec.models):
        where = f"{file}: models[{i}]"
        version = 0
        if entry.path and entry.load == "lazy":
            raise ConfigError(f"{where}.load: a lazily loaded model must come from the model_repo")
        if entry.path and entry.version is not None:
            raise ConfigError(f"{where}.version: only for a model from the model_repo (path names its files)")
        if entry.path:
            path = _model_path(entry.path, folder, f"{where}.path")
        elif repo is not None:
            try:
                mv = repo.get(entry.name, entry.version)
            except RepositoryError as exc:
                raise RepositoryConfigError(f"{where}.name: {exc} ({repo.root})") from None
            path, version = mv.path, mv.version
        else:
            raise ConfigError(f"{where}: give a path, or a model_repo to take {entry.name!r} from")
        models.append(ServedModel(name=entry.name, path=path, device=entry.device, dtype=entry.precision,
                                  quantization=entry.quantization or "", kv_cache_dtype=entry.kv_cache_dtype or "",
                                  tensor_parallel_size=entry.tensor_parallel_size or 0,
                                  pipeline_parallel_size=entry.pipeline_parallel_size or 0,
                                  pipeline_batch_queue=entry.pipeline_batch_queue,
                                  calculate_kv_scales=entry.calculate_kv_scales,
                                  version=version, pinned=entry.pinned, min_replicas=entry.min_replicas,
                                  keep_alive_s=entry.keep_alive_s, lazy=entry.load == "lazy"))
    return repo, models


def _model_path(given: str, folder: Path, where: str) -> str:
    """An HF directory or a .gguf file, from the file's folder when relative; the shipped default and
    ``dummy:<preset>`` as they are."""
    if given == DEFAULT_MODEL or given.startswith("dummy:"):
        return given
    path = folder / Path(given).expanduser()
    if not (path / "config.json").is_file() and not (path.is_file() and path.suffix == ".gguf"):
        raise ConfigError(f"{where}: {path} is neither an HF model directory (with config.json) nor a .gguf "
                          f"file{_relative_note(given)}")
    return str(path)


def _relative_note(given: str) -> str:
    return "" if Path(given).expanduser().is_absolute() else " (a relative path is taken from the file's folder)"


def _parse(file: str | Path) -> ServeFile:
    try:
        raw = yaml.safe_load(Path(file).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{file}: {' '.join(str(exc).split())}") from None
    try:
        return ServeFile.model_validate(raw if raw is not None else {})
    except ValidationError as exc:
        # a misspelt key first: it is why the rightly spelt one is "missing"
        err = min(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
        key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
        message = err["msg"].removeprefix("Value error, ")
        message = f"{message[0].lower()}{message[1:]}"
        if err["type"] == "extra_forbidden":
            message = "unknown key"
        elif err["type"] != "missing":
            message += f" (got {err['input']!r})"
        raise ConfigError(f"{file}: {key}: {message}" if key else f"{file}: {message}") from None
