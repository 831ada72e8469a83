"""Importing a model into the repository: an HF directory copied, a GGUF file converted once (or copied
from the conversion ``kvrelay serve`` cached), or the shipped SmolLM2; then checksummed into a manifest.
Apart from ``model_repo``, which only reads versions: the gateway reads the repository and never imports
into it, so it never reaches the GGUF converter (torch)."""

import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from kvrelay.shared.config.confined import RepositoryError
from kvrelay.shared.repo import gguf_import
from kvrelay.shared.repo.manifest import MANIFEST, ModelVersion
from kvrelay.shared.repo.model_repo import ModelRepository, check_name, confined
from kvrelay.shared.repo.model_shape import max_model_len
from kvrelay.shared.repo.model_source import DEFAULT_MODEL, gguf_cache_dir
from kvrelay.shared.repo.verified_files import sha256_file
from kvrelay.shared.text.progress import progress_bar

WEIGHT_SUFFIXES = (".safetensors", ".json", ".jinja", ".model", ".txt")


def import_model(repo: ModelRepository, source: str, name: str, version: int | None = None, progress: bool = True,
                 dtype: str = "auto", label: str | None = None) -> ModelVersion:
    """Copy an HF directory, a GGUF file (converted once), or 'smollm2' into a new version. ``label``: the
    manifest's ``source`` when ``source`` is an intermediate (a quantized copy made for this import)."""
    check_name(name)
    existing = repo.versions(name)
    version = (existing[-1] + 1 if existing else 1) if version is None else int(version)
    if version < 1 or version in existing:
        raise RepositoryError(f"{name} version {version} exists already (or is not a positive number)")
    final = confined(repo.root, name, str(version))
    staging = confined(repo.root, name, f".importing-{version}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        if source == DEFAULT_MODEL or source.endswith(".gguf"):
            gguf = gguf_import.smollm2_gguf_path() if source == DEFAULT_MODEL else Path(source)
            cached = gguf_cache_dir(gguf)
            if dtype == "auto" and (cached / "config.json").is_file():
                # `kvrelay serve` imported this file already: a copy takes seconds, converting it
                # again ~20 s of CPU for SmolLM2 (a cache is never filled from here: it would hold a
                # second copy of every model imported only into a repository)
                _copy_hf_dir(cached, staging, progress)
            else:
                gguf_import.import_gguf(gguf, staging, dtype=dtype, progress=progress)
        else:
            _copy_hf_dir(Path(source), staging, progress)
        manifest = version_manifest(staging, name, version, label or source, progress)
        (staging / MANIFEST).write_text(json.dumps({k: v for k, v in asdict(manifest).items() if k != "path"},
                                                   indent=2))
        staging.rename(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return repo.get(name, version)

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

def version_manifest(folder: Path, name: str, version: int, source: str, progress: bool) -> ModelVersion:
    """The manifest of a version's files in ``folder``: their checksums and what config.json says."""
    config = json.loads((folder / "config.json").read_text())
    files = sorted(p for p in folder.iterdir() if p.is_file())
    total = sum(p.stat().st_size for p in files)
    with progress_bar("checksums", total=total, unit="B", unit_scale=True, disable=not progress) as bar:
        digests = {p.name: sha256_file(p, bar) for p in files}
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    return ModelVersion(name=name, version=version, path=str(folder), dtype=dtype,
                        max_model_len=max_model_len(config),
                        architecture=(config.get("architectures") or ["?"])[0], files=digests,
                        source=str(source), created=time.time(),
                        quantization=str((config.get("quantization_config") or {}).get("quant_method", "")))
