"""The codec every cross-process message goes through: dataclasses as msgpack maps.

Never pickle: a pickle on a socket is remote code execution. ``decode`` treats the bytes as hostile:
size-bounded, every field type-checked against the dataclass annotations, cross-field invariants checked by
``check()``. Any violation raises ``ValueError`` so a receiver can drop the message with one ``except``.
Each encoded message carries a ``type`` tag so one socket can carry several kinds (``decode_any``); the
message modules (protocol.py, handoff.py) ``register`` theirs.

Rolling upgrades (one component at a time, peers one protocol version apart: version.py):
- a field equal to its default is not sent, so a newer sender that does not use a feature is read by an
  older peer as ever. A default therefore means "feature not used" and is part of the protocol: never
  change one; a field added later needs one (an older sender never sends it).
- a field declared ``IGNORABLE`` (metadata) is one a peer that does not know it may drop: the encoder names
  the ignorable fields it sent under ``IGNORABLE_KEY``; the decoder drops unknown fields named there and
  rejects any other unknown field (a must-understand one: the sender is newer and relies on it), so a
  request using a feature this process cannot honour fails loudly instead of running wrong.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

import msgpack

# Bounds on anything decoded. A control message this big is a bug or an attack, never a request.
MAX_MESSAGE_BYTES = 32 * 1024 * 1024
MAX_ARRAY_LEN = 4 * 1024 * 1024  # prompt token ids are the longest arrays
MAX_STR_LEN = 1024 * 1024
MAX_MAP_LEN = 4096
MAX_ID_LEN = 256  # request / worker ids, model names

# field metadata: a peer that does not know the field may ignore it (it needs a default: older peers never send it)
IGNORABLE = {"ignorable": True}
IGNORABLE_KEY = "~ignorable"  # the ignorable fields a map carries (never a field name: not an identifier)
# field metadata "absent": what a missing field means when that is not the field's default (version.py's field)
ABSENT = "absent"

_BY_TAG: dict[str, type] = {}
M = TypeVar("M")


def register(*classes: type) -> None:
    """Make ``classes`` encodable and decodable; each tag names one class."""
    for cls in classes:
        for f in dataclasses.fields(cls):
            _absent_value(f)  # an ignorable field without a default is refused here, where it is declared
        if _BY_TAG.setdefault(cls.TAG, cls) is not cls:
            raise ValueError(f"message tag {cls.TAG!r} is taken by {_BY_TAG[cls.TAG].__name__}")


def encode(msg: Any) -> bytes:
    if type(msg) not in _BY_TAG.values():
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    payload = _to_wire(msg)
    payload["type"] = msg.TAG
    data = msgpack.packb(payload, use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"{type(msg).__name__} encodes to {len(data)} bytes, over {MAX_MESSAGE_BYTES}")
    return data


def decode(data: bytes | memoryview, cls: type[M]) -> M:
    """Decode ``data`` as a ``cls`` message; raise ValueError on anything malformed."""
    return decode_any(data, cls)  # type: ignore[return-value]


def decode_any(data: bytes | memoryview, *classes: type) -> Any:
    """Decode a message whose tag is one of ``classes`` (all message types when none are given)."""
    raw = _unpack(data)
    tag = raw.pop("type", None)
    cls = _BY_TAG.get(tag) if isinstance(tag, str) else None
    if cls is None or (classes and cls not in classes):
        expected = ", ".join(c.TAG for c in classes) if classes else "a protocol message"
        raise ValueError(f"message type {tag!r} where {expected} was expected")
    return _build(cls, raw, cls.__name__)


def peek(data: bytes | memoryview) -> dict:
    """The map of a message that did not decode (a newer sender's, say), bounded as ``decode`` is and otherwise
    unchecked ({} when it is not even a map): what a receiver reads to tell the sender why it refused."""
    try:
        return _unpack(data)
    except ValueError:
        return {}


def peek_strings(data: bytes | memoryview, *names: str) -> dict[str, str]:
    """The named top-level string fields of a message that did not decode (``peek``)."""
    raw = peek(data)
    return {name: value for name in names if isinstance(value := raw.get(name), str)}


def _unpack(data: bytes | memoryview) -> dict:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ValueError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_str_len=MAX_STR_LEN,
                              max_bin_len=MAX_STR_LEN, max_array_len=MAX_ARRAY_LEN,
                              max_map_len=MAX_MAP_LEN, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ValueError(f"malformed msgpack: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"message must be a map, got {type(obj).__name__}")
    return obj


_PLAIN, _MESSAGE, _MESSAGES, _INT_MAP = 0, 1, 2, 3
_REQUIRED = object()  # a field with no default: always sent
_WIRE: dict[type, tuple[tuple[str, int, Any, bool], ...]] = {}


def _wire_fields(cls: type) -> tuple[tuple[str, int, Any, bool], ...]:
    """(field name, whether it holds a message / a list of messages, the value left off the wire, whether it is
    ignorable) per field, from the annotations, worked out once per class: encoding runs once per decode step
    for every gateway (a TokenBatch of up to max_num_seqs events), where asking each value whether it is a
    dataclass cost ~5 µs an event."""
    spec, hints = [], _hints(cls)
    for f in dataclasses.fields(cls):
        name, tp = f.name, hints[f.name]
        options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        kind = _PLAIN
        for option in options:
            if isinstance(option, type) and dataclasses.is_dataclass(option):
                kind = _MESSAGE
            elif typing.get_origin(option) is list and dataclasses.is_dataclass(typing.get_args(option)[0]):
                kind = _MESSAGES
            elif _int_keyed(option):
                kind = _INT_MAP
        spec.append((name, kind, _absent_value(f), bool(f.metadata.get("ignorable"))))
    _WIRE[cls] = spec = tuple(spec)
    return spec


def _absent_value(f: dataclasses.Field) -> Any:
    """What a decoder takes a missing field ``f`` for (the value its encoder leaves out); _REQUIRED if none."""
    if ABSENT in f.metadata:
        return f.metadata[ABSENT]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    if f.metadata.get("ignorable"):
        raise TypeError(f"ignorable field {f.name!r} needs a default: a peer that does not know it never sends it")
    return _REQUIRED


def _to_wire(msg: Any) -> dict:
    """The fields as a map, less those equal to their default (the decoder's default restores them): most of
    a TokenEvent's fields are None, and each one cost both ends a map entry; a newer sender not using a
    feature sends nothing an older peer would not know. The ignorable fields sent are named."""
    out, ignorable = {}, None
    for name, kind, absent, may_ignore in _WIRE.get(type(msg)) or _wire_fields(type(msg)):
        value = getattr(msg, name)
        if value is None:
            if absent is not None:
                out[name] = None
            continue
        if value is absent or (absent is not _REQUIRED and value == absent):
            continue
        if kind == _MESSAGE:
            value = _to_wire(value)
        elif kind == _MESSAGES:
            value = [_to_wire(v) for v in value]
        elif kind == _INT_MAP:
            value = [list(value), list(value.values())]
        out[name] = value
        if may_ignore:
            ignorable = ignorable or []
            ignorable.append(name)
    if ignorable:
        out[IGNORABLE_KEY] = ignorable
    return out


def _int_keyed(tp: Any) -> bool:
    """A ``dict[int, V]`` annotation. msgpack maps take string keys only here (``strict_map_key``), so such
    a map travels as two parallel arrays ``[keys, values]``, which are also smaller than a map."""
    return typing.get_origin(tp) is dict and typing.get_args(tp)[:1] == (int,)


def _build(cls: type[M], raw: Any, where: str) -> M:
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
_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
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
        if item_tp is int:  # the hot case (token ids): one pass, no calls
            def ints(value):
                if isinstance(value, list) and all(type(v) is int for v in value):
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
    if origin is dict and _int_keyed(tp):
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
    hints = _hints(cls)
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
