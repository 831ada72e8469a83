"""A repository version's manifest (``kvrelay-manifest.json`` in its folder): what was imported, from
where, and a sha256 per file, so a corrupt or truncated copy is caught before loading."""

from dataclasses import dataclass

MANIFEST = "kvrelay-manifest.json"


@dataclass
class ModelVersion:
    name: str
    version: int
    path: str
    dtype: str
    max_model_len: int
    architecture: str
    files: dict[str, str]  # file name -> sha256
    source: str
    created: float
    quantization: str = ""  # the checkpoint's quantization_config quant_method; "": full precision
