"""A child process's configuration, handed over by the process that starts it: the typed config as JSON
on the child's stdin, validated on arrival, strictly, by the same declaration. Not argv: flags rebuilt
from a parent's namespace are where settings used to be dropped, and ``ps`` shows argv to every local
user (the admin key travels in the config). Never pickle."""

import json
import sys
from typing import IO, Any

from pydantic import TypeAdapter, ValidationError

from kvrelay.shared.config.declare import ConfigError
from kvrelay.shared.wire.redacted_url import redact

CONFIG_FROM_STDIN = "--config-from-stdin"


def module_argv(module: str) -> list[str]:
    """The command line that starts a kvrelay child running ``module``. ``-P``: without it ``-m`` puts the
    working directory first on sys.path, and started from a checkout of this repository its top-level
    folders (``kernels/``, ``shared/``) would shadow installed packages of those names; transformers
    imports the Hugging Face ``kernels`` package and fails on ours."""
    return [sys.executable, "-P", "-m", module]


def encode(config: Any, exclude: set[str] | None = None) -> bytes:
    return TypeAdapter(type(config)).dump_json(config, exclude=exclude)


def receive(cls: type, stream: IO[str] | None = None) -> Any:
    text = (stream or sys.stdin).read()
    try:
        return TypeAdapter(cls).validate_json(text, strict=True)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(map(str, err["loc"]))  # none for a check of the whole config (role_settings.check)
        message = err["msg"].removeprefix("Value error, ")
        raise ConfigError(f"config from the parent: {where + ': ' if where else ''}{message}") from None


def printable(config: Any) -> str:
    """The resolved config as JSON (``--print-config``), secrets masked, URLs without their passwords."""
    data = TypeAdapter(type(config)).dump_python(config, mode="json")
    for name, info in type(config).__pydantic_fields__.items():
        if (info.json_schema_extra or {}).get("secret") and data.get(name) is not None:
            data[name] = "<set>"
        elif isinstance(data.get(name), str):
            data[name] = redact(data[name])
    return json.dumps(data, indent=1, sort_keys=True)
