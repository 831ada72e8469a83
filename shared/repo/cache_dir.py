"""This host's kvrelay cache (``$KVRELAY_CACHE``, default ``~/.cache/kvrelay``): GGUF imports, dummy
tokenizers and checksum stamps, shared by every process and virtualenv on the host."""

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("KVRELAY_CACHE", Path.home() / ".cache" / "kvrelay"))
