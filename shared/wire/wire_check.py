"""What ``decode`` checks a message's map against (codec.py): every value against its field's annotation,
each annotation compiled once into a checker; unknown fields only where their sender declared them ignorable."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

from kvrelay.shared.wire.limits import ABSENT, IGNORABLE_KEY, MAX_MAP_LEN

M = TypeVar("M")


def int_keyed(tp: Any) -> bool:
    """A ``dict[int, V]`` annotation. msgpack maps take string keys only here (``strict_map_key``), so such
    a map travels as two parallel arrays ``[keys, values]``, which are also smaller than a map."""
    return typing.get_origin(tp) is dict and typing.get_args(tp)[:1] == (int,)


def build(cls: type[M], raw: Any, where: str) -> M:
    try:
        return _checker(cls)(raw)
    except _Mismatch as exc:
        raise ValueError(exc.message(where)) from None


class _Mismatch(Exception):
    """A value that does not fit its annotation. Carries the path from the failing value up, joined only
    when reported: the happy path builds no location strings (decoding runs for every token batch)."""

    def __init__(self, text: str, path: str = "", value: Any = None, tp: Any = None):
        self.text, self.path, self.value, self.tp = text, path, value, tp

    def at(self, part: str) -> _Mismatch:
        self.path = part + self.path
        return self

    def message(self, where: str) -> str:
        text = self.text or f"{type(self.value).__name__} {_short(self.value)} does not match {_name(self.tp)}"
        return f"{where}{self.path}: {text}"


_CHECKERS: dict[Any, Any] = {}
_INT_ONLY = frozenset((int,))  # exactly int: a bool is no token id
_HINTS: dict[type, dict[str, Any]] = {}


def type_hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _checker(tp: Any):
    """``f(value)`` -> the value (tuples and floats normalized) if it matches annotation ``tp``, else
    raises _Mismatch. Compiled once per annotation."""
    f = _CHECKERS.get(tp)
    if f is None:
        f = _CHECKERS[tp] = _compile(tp)
    return f


def _mismatch(value: Any, tp: Any) -> _Mismatch:
    return _Mismatch("", value=value, tp=tp)  # the text is only made if the error is reported


def _compile(tp: Any):
    origin = typing.get_origin(tp)
    if tp is Any:
        return lambda value: value
    if origin in (typing.Union, types.UnionType):
        optional = type(None) in typing.get_args(tp)
        options = [_checker(o) for o in typing.get_args(tp) if o is not type(None)]
        if optional and len(options) == 1:  # ``X | None``: X's own mismatch says more than the union's
            (only,) = options

            def optional_one(value):
                return None if value is None else only(value)
            return optional_one

        def union(value):
            if value is None and optional:  # most optional fields are None: no failed attempt first
                return None
            for option in options:
                try:
                    return option(value)
                except _Mismatch:
                    continue
            raise _Mismatch(f"{type(value).__name__} does not match {tp}")
        return union
    if tp is type(None):
        def none(value):
            if value is None:
                return None
            raise _mismatch(value, tp)
        return none
    if tp in (bool, int, str, bytes):
        def exact(value):  # bool is no int here, and no int a bool
            if type(value) is tp or (tp is not bool and tp is not int and isinstance(value, tp)):
                return value
            raise _mismatch(value, tp)
        return exact
    if tp is float:
        def real(value):
            kind = type(value)
            if kind is float:
                return value
            if kind is int:
                return float(value)
            raise _mismatch(value, tp)
        return real
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if item_tp is int:  # the hot case (token ids): the types gathered in C, no Python call per item
            def ints(value):
                if isinstance(value, list) and _INT_ONLY.issuperset(map(type, value)):
                    return value
                raise _mismatch(value, tp)
            return ints
        item = _checker(item_tp)

        def items(value):
            if not isinstance(value, list):
                raise _mismatch(value, tp)
            out = []
            for i, v in enumerate(value):
                try:
                    out.append(item(v))
                except _Mismatch as exc:
                    raise exc.at(f"[{i}]") from None
            return out
        return items
    if origin is tuple:
        if typing.get_args(tp) == (int, float):  # a (token id, logprob) pair: the hot case of logprobs
            def pair(value):
                if type(value) in (list, tuple) and len(value) == 2 and type(value[0]) is int:
                    lp = value[1]
                    if type(lp) is float:
                        return (value[0], lp)
                    if type(lp) is int:
                        return (value[0], float(lp))
                raise _mismatch(value, tp)
            return pair
        parts = [_checker(a) for a in typing.get_args(tp)]

        def fixed(value):
            if not isinstance(value, list | tuple) or len(value) != len(parts):
                raise _mismatch(value, tp)
            out = []
            for i, (check, v) in enumerate(zip(parts, value, strict=True)):
                try:
                    out.append(check(v))
                except _Mismatch as exc:
                    raise exc.at(f"[{i}]") from None
            return tuple(out)
        return fixed
    if origin is dict and int_keyed(tp):
        value_check = _checker(typing.get_args(tp)[1])

        def int_map(value):
            if not (isinstance(value, list) and len(value) == 2 and all(isinstance(x, list) for x in value)):
                raise _Mismatch("expected [keys, values]")
            keys, values = value
            if len(keys) != len(values) or len(keys) > MAX_MAP_LEN:
                raise _Mismatch(f"{len(keys)} keys for {len(values)} values (at most {MAX_MAP_LEN} pairs)")
            if any(type(k) is not int for k in keys):
                raise _Mismatch("map keys must be integers")
            out = {}
            for k, v in zip(keys, values, strict=True):
                try:
                    out[k] = value_check(v)
                except _Mismatch as exc:
                    raise exc.at(f"[{k}]") from None
            if len(out) != len(keys):
                raise _Mismatch("a key is repeated")
            return out
        return int_map
    if origin is dict:
        def mapping(value):
            if isinstance(value, dict) and all(isinstance(k, str) for k in value):
                return value
            raise _mismatch(value, tp)
        return mapping
    if dataclasses.is_dataclass(tp):
        return _compile_message(tp)

    def never(value):
        raise _mismatch(value, tp)
    return never


def _compile_message(cls: type):
    hints = type_hints(cls)
    fields = []  # (name, absent, required, choices, max_len)
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        absent = f.metadata.get(ABSENT, dataclasses.MISSING)  # MISSING: the class's default
        fields.append((f.name, absent, required, f.metadata.get("choices"), f.metadata.get("max_len")))
    known = frozenset(f[0] for f in fields)
    checkers: dict[str, Any] = {}
    has_check = hasattr(cls, "check")

    def build(raw):
        if not isinstance(raw, dict):
            raise _Mismatch(f"expected a map, got {type(raw).__name__}")
        if not known.issuperset(raw):
            raw = _known_part(raw, known)
        kwargs = {}
        for name, absent, required, choices, max_len in fields:
            if name not in raw:
                if required:
                    raise _Mismatch(f"missing field {name!r}")
                if absent is not dataclasses.MISSING:
                    kwargs[name] = absent
                continue
            check = checkers.get(name)
            if check is None:  # resolved lazily: messages may refer to classes defined after them
                check = checkers[name] = _checker(hints[name])
            try:
                value = check(raw[name])
            except _Mismatch as exc:
                raise exc.at(f".{name}") from None
            if choices is not None and value is not None and value not in choices:
                raise _Mismatch(f"{value!r} is not one of {choices}", f".{name}")
            if max_len is not None and isinstance(value, str) and len(value) > max_len:
                raise _Mismatch(f"longer than {max_len} characters", f".{name}")
            kwargs[name] = value
        try:
            msg = cls(**kwargs)  # a class may validate itself on construction (SamplingParams does)
        except ValueError as exc:
            raise _Mismatch(str(exc)) from None
        if has_check:
            try:
                msg.check()
            except ValueError as exc:
                raise _Mismatch(str(exc)) from None
        return msg
    return build


def _known_part(raw: dict, known: frozenset) -> dict:
    """``raw`` less the unknown fields its sender declared ignorable; any other unknown field is refused: the
    sender is newer and relies on it being understood."""
    listed = raw.get(IGNORABLE_KEY, [])
    if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
        raise _Mismatch(f"{IGNORABLE_KEY} must be a list of field names")
    unknown = set(raw) - known - {IGNORABLE_KEY}
    refused = unknown.difference(listed)
    if refused:
        raise _Mismatch(f"unknown field(s) {', '.join(sorted(map(str, refused)))} that must be understood: the "
                        "sender speaks a newer wire protocol and uses a feature this process lacks (upgrade it)")
    return {k: v for k, v in raw.items() if k in known}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp)
