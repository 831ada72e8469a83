"""The versioned model repository: a local directory, one folder per model, numbered versions.

    <repo>/<name>/<version>/config.json, *.safetensors, tokenizer files, kvrelay-manifest.json

A version folder appears only when complete (written under a hidden temp name, then renamed), and
its manifest records dtype, max_model_len and a sha256 per file so a corrupt or truncated copy is
caught before loading. Every path that comes from a user (names, versions, admin API bodies) goes
through ``confined`` first: no ``..``, no absolute paths, no symlink that leads out of the repository.

The files of a version are confined too, not only its folder: ``get`` refuses a version any of whose
entries resolves outside the repository (a ``config.json`` linked to ``/etc/...`` was registered and
loaded), and whose manifest names another model or version than its folder. A link that stays inside
the repository (a shard shared with a sibling version) is allowed. Loading checks again and opens each
file by its resolved path (``inside``), since a link can be swapped in between.
"""

import json
import os
import re
from pathlib import Path

from kvrelay.shared.config.confined import RepositoryError, inside, joined
from kvrelay.shared.repo.manifest import MANIFEST, ModelVersion
from kvrelay.shared.repo.verified_files import sha256_file

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def confined(root: Path, *parts: str) -> Path:
    """``root/parts...`` resolved, or RepositoryError if it would leave ``root``."""
    return inside(root, joined(root, *parts), repr("/".join(parts)))


def check_version_files(root: Path, folder: Path, label: str) -> None:
    """Every entry under a version folder resolves inside ``root``: the loader, the tokenizer and the
    verifier open files by name (config.json, generation_config.json, shards an index names), so no entry
    may lead out, listed in the manifest or not."""
    for dirpath, dirnames, filenames in os.walk(folder):  # never follows a linked folder, only checks it
        for entry in dirnames + filenames:
            path = Path(dirpath, entry)
            inside(root, path, f"{label}: {path.relative_to(folder)}")


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise RepositoryError(f"model name {name!r} must match {NAME_RE.pattern}")
    return name


class ModelRepository:
    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)

    def versions(self, name: str) -> list[int]:
        folder = confined(self.root, check_name(name))
        if not folder.is_dir():
            return []
        return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and (p / MANIFEST).is_file())

    def get(self, name: str, version: int | None = None) -> ModelVersion:
        versions = self.versions(name)
        if not versions:
            raise RepositoryError(f"model {name!r} is not in the repository")
        version = versions[-1] if version is None else int(version)
        if version not in versions:
            raise RepositoryError(f"model {name!r} has no version {version} (has {versions})")
        folder = confined(self.root, name, str(version))
        label = f"{name} v{version}"
        check_version_files(self.root, folder, label)
        data = json.loads(inside(self.root, folder / MANIFEST, f"{label}: {MANIFEST}").read_text())
        if not isinstance(data, dict) or data.get("name") != name or data.get("version") != version:
            found = (data.get("name"), data.get("version")) if isinstance(data, dict) else (None, None)
            raise RepositoryError(f"{name}/{version}/{MANIFEST} describes {found[0]!r} version {found[1]!r}, "
                                  f"not the folder it is in")
        return ModelVersion(**{**data, "path": str(folder)})

    def list(self) -> list[ModelVersion]:
        out = []
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir() and NAME_RE.match(p.name)):
            out += [self.get(folder.name, v) for v in self.versions(folder.name)]
        return out

    def verify(self, mv: ModelVersion) -> None:
        """Raise RepositoryError naming the first file whose bytes differ from the manifest."""
        for fname, digest in mv.files.items():
            path = self.file(mv, fname)
            if not path.is_file():
                raise RepositoryError(f"{mv.name} v{mv.version}: {fname} is missing")
            if sha256_file(path) != digest:
                raise RepositoryError(f"{mv.name} v{mv.version}: {fname} is corrupt (checksum mismatch)")

    def file(self, mv: ModelVersion, fname: str) -> Path:
        """A file the manifest names, resolved inside the repository (a sibling version's shard is fine)."""
        return inside(self.root, joined(Path(mv.path), fname), f"{mv.name} v{mv.version}: {fname}")
