"""Settings that take effect only under another setting's value (not a role: that is role_settings.py), e.g.
``--pipeline-batch-queue`` only with a pipeline. Given where it would have no effect, such a setting is refused
in one line naming both keys, never accepted and ignored: a config built or handed over whole (the offline LLM,
a worker's config from kvrelay serve, each model's engine) refuses a value other than the setting's default
(``check``), a command line refuses the flag whenever it gives it, at its default value too (``check_given``).
Each config class lists its rules and calls ``check`` as it is built; the launchers call ``check_given``."""

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from kvrelay.shared.config.declare import ConfigError
from kvrelay.shared.config.role_settings import option


@dataclasses.dataclass(frozen=True)
class Needs:
    """``path`` (field names from the config class down to the setting) has no effect where ``inert`` says why
    (a reason naming the other key); where it returns "" the setting applies."""

    path: tuple[str, ...]
    inert: Callable[[Any], str]

    def owner(self, config: Any) -> tuple[Any, str]:
        for name in self.path[:-1]:
            config = getattr(config, name)
        return config, self.path[-1]

    def option(self, config: Any) -> str:
        owner, name = self.owner(config)
        return option(name, type(owner).__pydantic_fields__[name])


def check(config: Any, rules: Iterable[Needs]) -> None:
    """A setting at a value other than its default where it would have no effect: ValueError, one line."""
    for rule in rules:
        owner, name = rule.owner(config)
        info = type(owner).__pydantic_fields__[name]
        if getattr(owner, name) != info.get_default(call_default_factory=True) and (why := rule.inert(config)):
            raise ValueError(f"argument {rule.option(config)}: {why}")


def check_given(config: Any, rules: Iterable[Needs], given: set[str]) -> None:
    """A flag the command line gave (``flags.given``: its destinations) where its setting would have no effect
    in ``config``, the config built from that command line: ConfigError, one line."""
    for rule in rules:
        flag = rule.option(config)
        if flag.removeprefix("--").replace("-", "_") in given and (why := rule.inert(config)):
            raise ConfigError(f"argument {flag}: {why}")
