"""What a request's output must match (vLLM's ``structured_outputs`` / ``guided_*``), as it travels to the
engine: exactly one constraint, as text. The gateway maps the API's fields onto it (``response_format``,
``guided_json``, ``structured_outputs``, a required or named ``tool_choice``); the engine compiles it with
its grammar backend, caching by the text, so equal constraints written the same way compile once.

Validation here is structural (one constraint, sane sizes); whether a schema or grammar compiles is the
engine's to say, and it answers a request whose constraint does not compile with a 400 naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_CONSTRAINT_CHARS = 256 * 1024  # a schema or grammar this long is a mistake or an attack, not an API call
MAX_CHOICES = 1024


@dataclass
class StructuredOutputs:
    json: str | None = None  # a JSON Schema, serialized (canonically, by the gateway: sorted keys, no spaces)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # an EBNF grammar (GBNF-style, as vLLM's guided_grammar takes)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        """The one constraint set: 'json', 'json_object', 'regex', 'choice' or 'grammar'."""
        return next(name for name in _KINDS if _is_set(getattr(self, name)))

    def validate(self) -> None:
        chosen = [name for name in _KINDS if _is_set(getattr(self, name))]
        if len(chosen) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(_KINDS)}, "
                             f"got {', '.join(chosen) or 'none'}")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
            if value is not None and len(value) > MAX_CONSTRAINT_CHARS:
                raise ValueError(f"structured_outputs.{name} may be at most {MAX_CONSTRAINT_CHARS} characters, "
                                 f"got {len(value)}")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice or len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} strings")
            if any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("structured_outputs.choice entries must be non-empty strings")
            if sum(map(len, self.choice)) > MAX_CONSTRAINT_CHARS:
                raise ValueError(f"structured_outputs.choice may hold at most {MAX_CONSTRAINT_CHARS} characters")


_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _is_set(value: object) -> bool:
    return value is not None and value is not False
