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
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from kvrelay.shared.config.confined import RepositoryError, inside, joined
from kvrelay.shared.repo import gguf_import
from kvrelay.shared.repo.manifest import MANIFEST, ModelVersion
from kvrelay.shared.repo.model_shape import max_model_len
from kvrelay.shared.repo.model_source import DEFAULT_MODEL, gguf_cache_dir
from kvrelay.shared.repo.verified_files import sha256_file
from kvrelay.shared.text.progress import progress_bar

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
WEIGHT_SUFFIXES = (".safetensors", ".json", ".jinja", ".model", ".txt")


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


def _check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise RepositoryError(f"model name {name!r} must match {NAME_RE.pattern}")
    return name


class ModelRepository:
    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)

    def versions(self, name: str) -> list[int]:
        folder = confined(self.root, _check_name(name))
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

    def import_model(self, source: str, name: str, version: int | None = None, progress: bool = True,
                     dtype: str = "auto") -> ModelVersion:
        """Copy an HF directory, a GGUF file (converted once), or 'smollm2' into a new version."""
        _check_name(name)
        existing = self.versions(name)
        version = (existing[-1] + 1 if existing else 1) if version is None else int(version)
        if version < 1 or version in existing:
            raise RepositoryError(f"{name} version {version} exists already (or is not a positive number)")
        final = confined(self.root, name, str(version))
        staging = confined(self.root, name, f".importing-{version}-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            if source == DEFAULT_MODEL or source.endswith(".gguf"):
                gguf = gguf_import.smollm2_gguf_path() if source == DEFAULT_MODEL else Path(source)
                cached = gguf_cache_dir(gguf)
                if dtype == "auto" and (cached / "config.json").is_file():
                    # `kvrelay serve` imported this file already: a copy takes seconds, converting it
                    # again ~20 s of CPU for SmolLM2 (a cache is never filled from here: it would hold a
                    # second copy of every model imported only into a repository)
                    self._copy_hf_dir(cached, staging, progress)
                else:
                    gguf_import.import_gguf(gguf, staging, dtype=dtype, progress=progress)
            else:
                self._copy_hf_dir(Path(source), staging, progress)
            manifest = self._manifest(staging, name, version, source, progress)
            (staging / MANIFEST).write_text(json.dumps({k: v for k, v in asdict(manifest).items() if k != "path"},
                                                       indent=2))
            staging.rename(final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return self.get(name, version)

    @staticmethod
    def _copy_hf_dir(src: Path, dst: Path, progress: bool) -> None:
        if not (src / "config.json").is_file():
            raise RepositoryError(f"{src} is not an HF model directory (no config.json)")
        # a repository version's manifest describes that version: the new one gets its own
        files = [p for p in sorted(src.iterdir())
                 if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES) and p.name != MANIFEST]
        dst.mkdir(parents=True)
        total = sum(p.stat().st_size for p in files)
        with progress_bar(f"copying {src.name}", total=total, unit="B", unit_scale=True,
                          disable=not progress) as bar:
            for p in files:
                shutil.copyfile(p, dst / p.name)  # copies bytes, never a symlink out of the repository
                bar.update(p.stat().st_size)

    @staticmethod
    def _manifest(folder: Path, name: str, version: int, source: str, progress: bool) -> ModelVersion:
        config = json.loads((folder / "config.json").read_text())
        files = sorted(p for p in folder.iterdir() if p.is_file())
        total = sum(p.stat().st_size for p in files)
        with progress_bar("checksums", total=total, unit="B", unit_scale=True, disable=not progress) as bar:
            digests = {p.name: sha256_file(p, bar) for p in files}
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
        return ModelVersion(name=name, version=version, path=str(folder), dtype=dtype,
                            max_model_len=max_model_len(config),
                            architecture=(config.get("architectures") or ["?"])[0], files=digests,
                            source=str(source), created=time.time())
