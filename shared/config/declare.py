"""How a setting is declared: one typed dataclass field with its default, help and constraints. The CLI
flags (``flags.py``), YAML validation (``serve_config.py``) and the JSON a child process receives
(``handover.py``) are all built from these declarations, so a setting is written down once."""

import re
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import parse_qs, urlsplit

from pydantic import AfterValidator, ConfigDict, Field
from pydantic_core import PydanticUndefined

from kvrelay.shared.config.presets import DUMMY_PREFIX, PRESETS
from kvrelay.shared.wire import redis_cluster, redis_sentinel

# A misspelt key is an error, never a silently ignored setting; NaN and infinity are no one's value.
CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)


def _device(name: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        raise ValueError("must be auto, cpu, cuda or cuda:N")
    return name


# The query parameters of a rediss:// URL that redis-py hands to its TLS connection (file paths and
# checks); anything else there would reach redis-py as an unknown keyword, or be a typo ignored.
_TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_ca_path")
_TLS_CHOICES = {"ssl_cert_reqs": ("none", "optional", "required"), "ssl_check_hostname": ("true", "false")}


def _redis_url(url: str) -> str:
    sentinel = redis_sentinel.is_sentinel_url(url)
    if sentinel:
        tls = redis_sentinel.parse(url).tls  # the hosts and the master name: ValueError says what is wrong
    elif url.startswith(("redis-cluster://", "rediss-cluster://")):
        redis_cluster.parse(url)  # its nodes and database; the TLS options below
        tls = url.startswith("rediss-cluster://")
    elif not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("must be a redis://, rediss://, unix://, redis+sentinel://, rediss+sentinel://, "
                         "redis-cluster:// or rediss-cluster:// URL")
    else:
        tls = url.startswith("rediss://")
    allowed = (*(redis_sentinel.SENTINEL_OPTIONS if sentinel else ()), *((*_TLS_FILES, *_TLS_CHOICES) if tls else ()))
    for name, values in parse_qs(urlsplit(url).query, keep_blank_values=True).items():
        value = values[-1]
        if name not in allowed:
            tls_options = ", ".join((*_TLS_FILES, *_TLS_CHOICES))
            takes = (f"redis+sentinel:// takes {', '.join(redis_sentinel.SENTINEL_OPTIONS)}, rediss+sentinel:// "
                     f"also {tls_options}" if sentinel else f"rediss:// takes {tls_options}")
            raise ValueError(f"unknown URL parameter {name!r} ({takes})")
        if name in _TLS_CHOICES and value.lower() not in _TLS_CHOICES[name]:
            raise ValueError(f"{name} must be one of {', '.join(_TLS_CHOICES[name])} (got {value!r})")
        if name in _TLS_FILES and not Path(value).exists():
            raise ValueError(f"{name}: no file {value}")
    return url


def _existing_dir(path: str) -> str:
    # checked where it is given, before anything loads: a mistyped folder was an empty repository (or a
    # tokenizer that failed) minutes later
    if not Path(path).expanduser().is_dir():
        raise ValueError(f"no directory {Path(path).expanduser().absolute()}")
    return path


def _model(name: str) -> str:
    # a dummy preset is checked where it is given: an unknown one was a loader traceback once serving started
    if name.startswith(DUMMY_PREFIX) and name[len(DUMMY_PREFIX):] not in PRESETS:
        raise ValueError(f"unknown model preset {name[len(DUMMY_PREFIX):]!r}; known: {', '.join(sorted(PRESETS))}")
    return name


def _power_of_two(n: int) -> int:
    if n < 1 or n & (n - 1):
        raise ValueError("must be a power of two")
    return n


DType = Literal["auto", "float32", "float16", "bfloat16"]  # auto: float32 on CPU, bfloat16 on CUDA
Device = Annotated[str, AfterValidator(_device)]  # auto: CUDA when present
Port = Annotated[int, Field(ge=0, le=65535)]  # 0: an ephemeral port
RedisUrl = Annotated[str, AfterValidator(_redis_url)]
PowerOfTwo = Annotated[int, AfterValidator(_power_of_two)]
ExistingDir = Annotated[str, AfterValidator(_existing_dir)]
ModelName = Annotated[str, AfterValidator(_model)]  # a path, 'smollm2', or dummy:<preset>



class ConfigError(ValueError):
    """A configuration mistake, said in one line that names the flag or the file and key."""


def setting(default: Any = PydanticUndefined, help: str = "", *, flag: str | None = None, shared: bool = False,
            secret: bool = False, env: str | None = None, roles: tuple[str, ...] = (), default_factory=None,
            **constraints) -> Any:
    """A config field with a flag. ``flag`` overrides the generated ``--field-name``; ``shared`` marks a setting
    two roles have with the same meaning, which ``kvrelay serve`` takes once for both; ``secret`` is masked
    when printed; ``env`` names an environment variable that gives the flag's default; ``roles`` names the
    worker roles that read a worker setting (empty: every role), and any other role rejects it
    (shared/config/role_settings.py). A field declared without ``setting`` has no flag: its launcher derives
    it (the model's name, the role) or it is internal."""
    extra = {"flag": flag, "shared": shared, "secret": secret, "env": env, "roles": list(roles)}
    if default_factory is not None:
        return Field(default_factory=default_factory, description=help, json_schema_extra=extra,
                     repr=not secret, **constraints)
    return Field(default, description=help, json_schema_extra=extra, repr=not secret, **constraints)
