"""Handoff asks and grants this process cannot read because their sender is newer (a must-understand field it
does not know: shared/wire/codec.py). Dropping one would leave its sender waiting out a timeout (and a decode
worker holding the seat of a grant nobody uses), so the request ids it is about are read, checked for type only,
and answered at once: an ask with a refusal, a grant by retrying elsewhere and giving it back. Anything that is not
even a map of an ask's or grant's tag names no request: nothing to answer."""

from dataclasses import dataclass

from kvrelay.shared.wire.codec import decode_each, peek
from kvrelay.shared.wire.handoff import MAX_ASKS, HandoffGrant, HandoffGrants, HandoffRequest, HandoffRequests
from kvrelay.shared.wire.limits import MAX_ID_LEN

MAX_REASON_CHARS = 1024  # of a codec line echoed back: it names the unknown fields, which the sender chose


@dataclass(frozen=True)
class Unread:
    """What could be read of one ask or grant that did not decode (0: not readable, or not sent)."""

    request_id: str
    ask: int = 0
    epoch: int = 0
    accepted: bool = True  # a grant's; not readable: taken for accepted, so it is given back


def unread_asks(data: bytes | memoryview) -> list[Unread]:
    return _unread(data, HandoffRequest.TAG, HandoffRequests.TAG, "requests")


def unread_grants(data: bytes | memoryview) -> list[Unread]:
    return _unread(data, HandoffGrant.TAG, HandoffGrants.TAG, "grants")


def asks_one_by_one(data: bytes | memoryview) -> list[HandoffRequest | HandoffGrant]:
    """A step of asks that did not decode whole, ask by ask: each readable ask itself, each unreadable one that
    names its request as its refusal (the codec's line for it, its number echoed), so one newer ask does not cost
    the others their grants. [] when ``data`` is no step of asks, or the step is unreadable as a whole."""
    out: list[HandoffRequest | HandoffGrant] = []
    for item, ask in decode_each(data, HandoffRequests, "requests", HandoffRequest, MAX_ASKS):
        if isinstance(ask, HandoffRequest):
            out.append(ask)
        elif (unread := _read(item)) is not None:
            out.append(refusal([unread], str(ask)))
    return out


def refusal(asks: list[Unread], reason: str) -> HandoffGrant | HandoffGrants:
    """The answer to ``asks`` (1..MAX_ASKS), which did not decode for ``reason``: each refused, its number echoed."""
    reason = reason[:MAX_REASON_CHARS]
    grants = [HandoffGrant(request_id=a.request_id, accepted=False, reason=reason, ask=a.ask) for a in asks]
    return grants[0] if len(grants) == 1 else HandoffGrants(grants)


def _unread(data: bytes | memoryview, single: str, batch: str, key: str) -> list[Unread]:
    raw = peek(data)
    tag = raw.get("type")
    items = [raw] if tag == single else raw.get(key) if tag == batch else None
    if not isinstance(items, list):
        return []
    # no more than a message of them may carry
    return [unread for item in items[:MAX_ASKS] if (unread := _read(item)) is not None]


def _read(item) -> Unread | None:
    rid = item.get("request_id") if isinstance(item, dict) else None
    if not (isinstance(rid, str) and 0 < len(rid) <= MAX_ID_LEN):
        return None
    return Unread(rid, _count(item, "ask"), _count(item, "epoch"), item.get("accepted") is not False)


def _count(item: dict, name: str) -> int:
    value = item.get(name)
    return value if type(value) is int and 0 < value < 2**63 else 0
