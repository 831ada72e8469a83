"""Worker settings that only some roles read (``setting(roles=...)``): applied by those roles, rejected by
any other, never accepted and ignored. On a worker's command line such a flag is an error as it is parsed
(``flags.add_flags(role=...)``); in a config built or handed over whole (kvrelay serve's, on stdin) a value
other than the setting's default is; kvrelay serve hands each worker only the settings its role reads and
refuses one its command line gives that no process it starts reads (``flags.given``)."""

from typing import Any

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


def check(config: Any) -> None:
    """A setting ``config.role`` does not read must hold its default: one line naming its flag."""
    for name, info in type(config).__pydantic_fields__.items():
        if not reads(info, config.role) and getattr(config, name) != info.get_default(call_default_factory=True):
            raise ValueError(f"argument {option(name, info)}: {who_reads(roles_of(info))} (this is a "
                             f"{config.role} worker)")
