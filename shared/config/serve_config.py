"""``kvrelay serve --config FILE``: the models to serve and where they come from, in YAML.

    model_repo: {type: local, path: ./model_repo, versioning: numbered}
    models:
      - {name: smollm2, version: 1, device: auto, precision: auto, pinned: true}   # from the repository
      - {name: tiny, path: /models/tiny-hf-dir, precision: float32}  # an HF dir or .gguf, as --model takes
      - {name: big, version: 2, load: lazy, keep_alive_s: 600}  # registered; loaded on its first request

Per model, optional: ``pinned`` (never evicted), ``min_replicas``, ``keep_alive_s`` (unload after that
long idle), ``load`` (``startup``, the default, or ``lazy``: registered only, loaded on first request;
lazy models must come from the repository).
"""

from dataclasses import dataclass
from pathlib import Path

import yaml
from kvrelay.shared.config.engine import DTYPES
from kvrelay.shared.repo.model_repo import ModelRepository


@dataclass
class ServedModel:
    name: str
    path: str  # what --model receives
    device: str = "auto"
    dtype: str = "auto"
    version: int = 0  # from the repository; 0 for a path
    pinned: bool = False
    min_replicas: int = 0
    keep_alive_s: float = 0.0
    lazy: bool = False


def load_serve_config(file: str | Path) -> tuple[ModelRepository | None, list[ServedModel]]:
    raw = yaml.safe_load(Path(file).read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: expected a mapping at the top level")
    repo = None
    repo_cfg = raw.get("model_repo")
    if repo_cfg is not None:
        if repo_cfg.get("type", "local") != "local":
            raise ValueError(f"model_repo.type {repo_cfg.get('type')!r}: only 'local' is supported")
        if repo_cfg.get("versioning", "numbered") != "numbered":
            raise ValueError("model_repo.versioning: only 'numbered' is supported")
        base = Path(file).parent
        repo = ModelRepository(base / Path(repo_cfg.get("path", "model_repo")).expanduser())
    models = []
    for i, entry in enumerate(raw.get("models") or []):
        where = f"{file}: models[{i}]"
        if not isinstance(entry, dict) or not entry.get("name"):
            raise ValueError(f"{where}: needs a name")
        precision = entry.get("precision", "auto")
        if precision != "auto" and precision not in DTYPES:
            raise ValueError(f"{where}: precision must be auto or one of {', '.join(DTYPES)}")
        version = 0
        if entry.get("path"):
            path = str(entry["path"])
        elif repo is not None:
            mv = repo.get(entry["name"], entry.get("version"))
            path, version = mv.path, mv.version
        else:
            raise ValueError(f"{where}: give a path, or a model_repo to take {entry['name']!r} from")
        load = entry.get("load", "startup")
        if load not in ("startup", "lazy"):
            raise ValueError(f"{where}: load must be startup or lazy")
        if load == "lazy" and not version:
            raise ValueError(f"{where}: a lazily loaded model must come from the model_repo")
        models.append(ServedModel(name=entry["name"], path=path, device=entry.get("device", "auto"),
                                  dtype=precision, version=version, pinned=bool(entry.get("pinned", False)),
                                  min_replicas=int(entry.get("min_replicas", 0)),
                                  keep_alive_s=float(entry.get("keep_alive_s", 0)), lazy=load == "lazy"))
    if not models:
        raise ValueError(f"{file}: no models listed")
    if len({m.name for m in models}) != len(models):
        raise ValueError(f"{file}: model names must be unique")
    return repo, models
