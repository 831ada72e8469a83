"""The per-layer K/V scales an fp8 KV cache divides by (shared/engine/kv_dtype.py), read from the checkpoint.

vLLM's names, any of them (``KV_SCALE_NAME``): ``self_attn.k_scale`` / ``v_scale`` (llm-compressor,
quark), ``self_attn.k_proj.k_scale`` / ``v_proj.v_scale`` (ModelOpt), ``k_proj.output_scale`` /
``v_proj.output_scale`` (older compressed-tensors), one ``kv_scale`` for both (AutoFP8). A checkpoint has
them for every layer or for none: a partial set is a corrupt or mismatched checkpoint, refused in one line
naming the first tensor it lacks, since a layer left at 1.0 beside calibrated ones is silently worse.

Read from the files directly, not with the weights: a process whose weights are mapped from another
loads no tensors of its own, and its cache must read blocks as the other's does. The table travels to
tensor- and pipeline-parallel ranks in their config (shared/engine/ranks/rank_config.py), and its digest
in every handoff ask (``HandoffRequest.kv_scales``): blocks written under one set of scales are refused by
a decode worker holding another, as blocks of another dtype are. ``--calculate-kv-scales`` replaces the table
with scales measured as the engine starts (shared/engine/kv_calibration.py), and the digest with theirs."""

import hashlib
import logging
import struct
from pathlib import Path

from safetensors import safe_open

from kvrelay.shared.config.engine import ModelConfig
from kvrelay.shared.config.presets import DUMMY_PREFIX
from kvrelay.shared.engine.kv_dtype import FP8_NAMES, KV_SCALE_NAME, kv_scale_entry
from kvrelay.shared.engine.loader import read_hf_config, read_safetensors_header, safetensors_files
from kvrelay.shared.engine.models.layers import cfg_get

log = logging.getLogger(__name__)

KVScales = list[list[float]]  # [layer][K, V] for every layer of the model; [] = 1.0 everywhere


def cache_kv_scales(model_config: ModelConfig, kv_cache_dtype: str, root: Path | None = None) -> KVScales | None:
    """The scales of a ``kv_cache_dtype`` cache: an fp8 cache's from the checkpoint ([] when it has none);
    None for a cache of the model's dtype, which stores K and V unscaled, so a checkpoint's are ignored
    (said once)."""
    if _dummy(model_config):
        return [] if kv_cache_dtype in FP8_NAMES else None
    if kv_cache_dtype in FP8_NAMES:
        _check_scheme(model_config, root)
        scales = _checkpoint_scales(model_config, root)
        if not scales:
            log.info("%s carries no KV cache scales: the fp8 KV cache uses 1.0 for every layer", model_config.model)
        return scales
    if _scale_names(model_config, root):
        log.info("%s carries fp8 KV cache scales; --kv-cache-dtype %s ignores them (they apply to "
                 "--kv-cache-dtype fp8 only)", model_config.model, kv_cache_dtype)
    return None


def _check_scheme(model_config: ModelConfig, root: Path | None) -> None:
    """A compressed-tensors ``kv_cache_scheme`` other than 8-bit float per tensor calibrated scales for another
    cache (int8 KV, per-head): read as fp8 per-layer scales they would misread every block, so refuse."""
    qc = read_hf_config(Path(model_config.model), root).get("quantization_config") or {}
    scheme = qc.get("kv_cache_scheme")
    if not scheme:
        return
    kind, bits, strategy = scheme.get("type"), scheme.get("num_bits"), scheme.get("strategy", "tensor")
    if kind != "float" or bits != 8 or strategy != "tensor":
        raise ValueError(f"quantization_config.kv_cache_scheme {{type {kind!r}, num_bits {bits!r}, strategy "
                         f"{strategy!r}}}: --kv-cache-dtype fp8 reads 8-bit float scales per tensor (one per layer) "
                         "only")


def _checkpoint_scales(model_config: ModelConfig, root: Path | None) -> KVScales:
    """[layer][K, V] of the KV scales the checkpoint carries for every layer, [] when it carries none."""
    found: dict[tuple[int, int], float] = {}  # (layer, 0 = K / 1 = V) -> scale
    for file, names in _scale_names(model_config, root).items():
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for name in names:
                layer, which, scale = kv_scale_entry(name, reader.get_tensor(name))
                found.update({(layer, w): scale for w in which})
    if not found:
        return []
    num_layers = cfg_get(read_hf_config(Path(model_config.model), root), "num_hidden_layers", "n_layer")
    for layer in range(num_layers):
        for which in (0, 1):
            if (layer, which) not in found:
                have = len({i for i, _ in found})
                names = [n for in_file in _scale_names(model_config, root).values() for n in in_file]
                raise ValueError(f"KV scale {_name_like(names, layer, which)!r} is missing: the checkpoint has "
                                 f"KV cache scales for {have} of its {num_layers} layers; every layer needs "
                                 "its K and V scale")
    return [[found[(layer, 0)], found[(layer, 1)]] for layer in range(num_layers)]


def scales_digest(scales: KVScales | None, num_layers: int) -> str:
    """A short digest of the scales an fp8 cache reads its blocks with (1.0 for every layer when ``scales`` is
    []); "" for a cache without scales (None). Equal digests: the two caches mean the same by the same bytes."""
    if scales is None:
        return ""
    flat = [s for row in (scales or [[1.0, 1.0]] * num_layers) for s in row]
    return hashlib.sha256(struct.pack(f"<{len(flat)}f", *flat)).hexdigest()[:16]


def _dummy(model_config: ModelConfig) -> bool:
    return model_config.load_format == "dummy" or model_config.model.startswith(DUMMY_PREFIX)


def _scale_names(model_config: ModelConfig, root: Path | None) -> dict[Path, list[str]]:
    """file -> the KV scale tensors in it, from the headers alone."""
    files = safetensors_files(Path(model_config.model), root)
    named = {file: [n for n in read_safetensors_header(file) if KV_SCALE_NAME.search(n)] for file in files}
    return {file: names for file, names in named.items() if names}


def _name_like(names: list[str], layer: int, which: int) -> str:
    """The name layer ``layer``'s K (0) or V (1) scale has in a checkpoint naming its others ``names``."""
    def covers(name: str) -> bool:
        kind = KV_SCALE_NAME.search(name).group(2)
        return kind == "kv_scale" or kind.startswith("kv"[which])

    template = next((n for n in names if covers(n)), names[0])
    match = KV_SCALE_NAME.search(template)
    suffix = template[match.end(1):]
    if not covers(template):  # the checkpoint has only the other half: name this half as its pair
        k, v = (".k_proj.", ".v_proj."), (".k_scale", ".v_scale")
        for pair in (k, v):
            suffix = suffix.replace(pair[1 - which], pair[which])
    return template[:match.start(1)] + str(layer) + suffix
