"""CLI flags generated from config declarations (the idea of vLLM's ``EngineArgs.add_cli_args``): one flag
per declared field, named after it (``max_num_seqs`` -> ``--max-num-seqs``) unless the field names its
own, booleans as ``--x/--no-x``, choices from ``Literal`` types, and each value checked against the
field's type and constraints as it is parsed, so a bad value is one line naming the flag (exit 2)."""

import argparse
import dataclasses
import os
import typing
from collections.abc import Iterable, Mapping
from typing import Annotated, Any

from pydantic import TypeAdapter, ValidationError
from pydantic.dataclasses import is_pydantic_dataclass
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from kvrelay.shared.config import role_settings
from kvrelay.shared.config.declare import CONFIG, ConfigError
from kvrelay.shared.wire.redacted_url import redact

GIVEN = "given_flags"  # the namespace attribute holding the destinations of the flags a command line gave


def given(args: argparse.Namespace) -> set[str]:
    """The destinations of the flags the command line gave, a value equal to the default included."""
    return getattr(args, GIVEN, set())


class _Noted:
    """An action that also notes its flag as given (``given``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        setattr(namespace, GIVEN, given(namespace) | {self.dest})


class _Store(_Noted, argparse._StoreAction):
    pass


class _Switch(_Noted, argparse.BooleanOptionalAction):
    pass


class Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one line (``kvrelay serve: error: argument --max-num-seqs: ...``)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


@dataclasses.dataclass(frozen=True)
class Flag:
    path: tuple[str, ...]  # field names from the config class down to this field
    option: str  # --max-num-seqs
    info: FieldInfo
    group: str  # the declaring class, for --help: model, cache, scheduler, engine, worker, gateway, serve

    @property
    def dest(self) -> str:
        return self.option.removeprefix("--").replace("-", "_")

    def meta(self, key: str) -> Any:
        return (self.info.json_schema_extra or {}).get(key)

    @property
    def default(self) -> Any:
        env = self.meta("env")
        if env and os.environ.get(env):
            return os.environ[env]
        return None if self.info.default is PydanticUndefined else self.info.default


def flags_of(cls: type, rename: Mapping[str, str] | None = None, _path: tuple[str, ...] = ()) -> list[Flag]:
    """The flags of ``cls``'s declared fields, nested config dataclasses included; ``rename`` maps a field
    name to another option (``kvrelay serve`` says ``--worker-port`` for a worker's ``port``)."""
    flags: list[Flag] = []
    for name, info in cls.__pydantic_fields__.items():
        if is_pydantic_dataclass(info.annotation):
            flags += flags_of(info.annotation, rename, _path + (name,))
        elif info.description:
            option = (rename or {}).get(name) or (info.json_schema_extra or {}).get("flag") or \
                "--" + name.replace("_", "-")
            flags.append(Flag(_path + (name,), option, info, cls.__name__.removesuffix("Config").lower()))
    return flags


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag], titles: Mapping[str, str],
              defaults: Mapping[str, Any] | None = None, notes: Mapping[str, str] | None = None,
              role: str | None = None) -> None:
    """Adds each flag to its group (``titles``: group -> title shown by --help); a flag already present
    with the same destination is a shared setting and stays as it is. ``defaults`` and ``notes`` (said in
    the help) are per destination, for a launcher whose default differs (kvrelay serve's Redis). ``role``:
    a worker role's command line, where a flag of a setting that role does not read is an error."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in flags:
        if role is not None and not role_settings.reads(flag.info, role):
            _add_rejected(parser, flag, role)
            continue
        if flag.option in parser._option_string_actions:
            if parser._option_string_actions[flag.option].dest != flag.dest or not flag.meta("shared"):
                raise ValueError(f"{flag.option} is declared twice with different meanings")
            continue
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(titles[flag.group])
        group = groups[flag.group]
        default = (defaults or {}).get(flag.dest, flag.default)
        kw: dict[str, Any] = {"dest": flag.dest, "default": default, "help": flag.info.description}
        if is_switch(flag):
            kw["help"] += " (default: auto)" if default is None else " (default: on)" if default else " (default: off)"
            group.add_argument(flag.option, action=_Switch, **kw)
            continue
        if flag.dest in (notes or {}):
            kw["help"] += f" ({notes[flag.dest]})"
        elif default is not None and not flag.meta("secret"):  # a default from the environment may be a URL
            kw["help"] += f" (default: {redact(str(default))})".replace("%", "%%")
        choices = _literal_choices(flag.info.annotation)
        if choices:
            group.add_argument(flag.option, action=_Store, choices=choices, **kw)
        else:
            group.add_argument(flag.option, action=_Store, type=_checker(flag), **kw)


def read(flags: Iterable[Flag], args: argparse.Namespace) -> dict[str, Any]:
    """The parsed values as nested keyword arguments of the config class the flags came from. A field
    with a default factory (a worker's generated id) is left to it when its flag is not given."""
    values: dict[str, Any] = {}
    for flag in flags:
        value = getattr(args, flag.dest)
        if value is None and flag.info.default_factory is not None:
            continue
        node = values
        for name in flag.path[:-1]:
            node = node.setdefault(name, {})
        node[flag.path[-1]] = value
    return values


def build(cls: type, values: Mapping[str, Any], flags: Iterable[Flag]) -> Any:
    """``cls`` from ``read``'s values (plus what the launcher derived); a value a field rejects becomes a
    ConfigError naming its flag."""
    try:
        return TypeAdapter(cls).validate_python(values)
    except ValidationError as exc:
        raise flag_error(exc, flags) from None


def flag_error(exc: ValidationError, flags: Iterable[Flag]) -> ConfigError:
    err = exc.errors()[0]
    loc = tuple(str(p) for p in err["loc"])
    where = next((f"argument {f.option}" for f in flags if loc[:len(f.path)] == f.path), ".".join(loc))
    message = err["msg"].removeprefix("Value error, ")
    return ConfigError(f"{where}: {message}" if where else message)


def _add_rejected(parser: argparse.ArgumentParser, flag: Flag, role: str) -> None:
    """The flag (and its --no- form) as an error naming it, not in --help; its setting keeps its default."""
    why = role_settings.who_reads(role_settings.roles_of(flag.info))

    class Rejected(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"argument {option_string}: {why} (this is a {role} worker)")

    options = [flag.option] + (["--no-" + flag.option[2:]] if is_switch(flag) else [])
    parser.add_argument(*options, action=Rejected, nargs="?", dest=flag.dest, default=flag.default,
                        help=argparse.SUPPRESS)


def is_switch(flag: Flag) -> bool:
    """A yes/no setting, given as --x / --no-x; ``bool | None`` is one whose default (None) the engine
    decides from what it runs on."""
    return flag.info.annotation in (bool, bool | None)


def _literal_choices(annotation: Any) -> list[str] | None:
    return list(typing.get_args(annotation)) if typing.get_origin(annotation) is typing.Literal else None


def _checker(flag: Flag):
    info = flag.info
    adapter = TypeAdapter(Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation,
                          config=CONFIG)

    def check(text: str) -> Any:
        try:
            return adapter.validate_python(text)
        except ValidationError as exc:
            message = exc.errors()[0]["msg"].removeprefix("Value error, ")
            # stderr may end up in a log: a URL's password does not
            raise argparse.ArgumentTypeError(f"{message} (got {redact(text)!r})") from None

    return check
