"""Worker and engine settings that only some worker roles read (``setting(roles=...)``): applied by those roles,
rejected by any other, never accepted and ignored. On a worker's command line such a flag is an error as it is
parsed (``flags.add_flags(role=...)``); in a config built or handed over whole (kvrelay serve's, on stdin) a value
other than the setting's default is, in the worker's engine settings and in each of its models' too; kvrelay
serve hands each worker only the settings its role reads and refuses one its command line gives that no process
it starts reads (``flags.given``). An engine config alone (the offline LLM API) has no role: nothing refused."""

from typing import Any

from pydantic.dataclasses import is_pydantic_dataclass
from pydantic.fields import FieldInfo

ROLES = ("prefill", "decode", "unified")


def roles_of(info: FieldInfo) -> tuple[str, ...]:
    """The roles that read the setting (empty: every role)."""
    return tuple((info.json_schema_extra or {}).get("roles") or ())


def reads(info: FieldInfo, role: str) -> bool:
    roles = roles_of(info)
    return not roles or role in roles


def who_reads(roles: tuple[str, ...]) -> str:
    """``only the prefill worker uses it``, ``only the prefill and decode workers use it``."""
    if len(roles) == 1:
        return f"only the {roles[0]} worker uses it"
    return f"only the {', '.join(roles[:-1])} and {roles[-1]} workers use it"


def option(name: str, info: FieldInfo) -> str:
    return (info.json_schema_extra or {}).get("flag") or "--" + name.replace("_", "-")


def check(config: Any, role: str | None = None) -> None:
    """A setting ``role`` (default: ``config.role``) does not read must hold its default, in ``config`` and in
    the configs it holds (its engine's, each startup model's): one line naming its flag."""
    role = role or config.role
    for name, info in type(config).__pydantic_fields__.items():
        value = getattr(config, name)
        for held in value if isinstance(value, list) else [value]:
            if is_pydantic_dataclass(type(held)):
                check(held, role)
        if not reads(info, role) and value != info.get_default(call_default_factory=True):
            raise ValueError(f"argument {option(name, info)}: {who_reads(roles_of(info))} (this is a {role} worker)")
