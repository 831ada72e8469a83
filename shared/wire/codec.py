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

from kvrelay.shared.wire.limits import ABSENT, IGNORABLE_KEY, MAX_ARRAY_LEN, MAX_MAP_LEN, MAX_MESSAGE_BYTES, MAX_STR_LEN
from kvrelay.shared.wire.wire_check import build, int_keyed, type_hints

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
    return build(cls, raw, cls.__name__)


def decode_each(data: bytes | memoryview, batch: type, key: str, cls: type[M],
                max_items: int) -> list[tuple[Any, M | ValueError]]:
    """A ``batch`` message that did not decode whole, its items (the list under ``key``) decoded one by one: each
    raw item with its ``cls`` message or the ValueError it raised, so a receiver refuses only the items it cannot
    read (a newer sender's). [] when ``data`` is no such batch, has more than ``max_items``, or fails for more than
    its items (the batch's own fields): then nothing of it is taken."""
    raw = peek(data)
    items = raw.get(key) if raw.get("type") == batch.TAG else None
    if not isinstance(items, list) or len(items) > max_items:
        return []
    out: list[tuple[Any, Any]] = []
    for i, item in enumerate(items):
        try:
            out.append((item, build(cls, item, f"{batch.__name__}.{key}[{i}]")))
        except ValueError as exc:
            out.append((item, exc))
    readable = [item for item, msg in out if not isinstance(msg, ValueError)]
    if readable:  # the batch itself, less the unreadable items, must be sound before any item is taken
        try:
            build(batch, {**{k: v for k, v in raw.items() if k != "type"}, key: readable}, batch.__name__)
        except ValueError:
            return []
    return out


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
    spec, hints = [], type_hints(cls)
    for f in dataclasses.fields(cls):
        name, tp = f.name, hints[f.name]
        options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        kind = _PLAIN
        for option in options:
            if isinstance(option, type) and dataclasses.is_dataclass(option):
                kind = _MESSAGE
            elif typing.get_origin(option) is list and dataclasses.is_dataclass(typing.get_args(option)[0]):
                kind = _MESSAGES
            elif int_keyed(option):
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
