"""The wire protocol's version: one integer, carried by heartbeats (WorkerInfo) and handoff asks and grants.

Peers one version apart work together (codec.py: fields a peer does not know are dropped when the sender
declared them ignorable, refused otherwise); peers further apart are refused, so an operator rolls a new
version over a running cluster one component at a time, one version at a time. Raise it when a release
changes what travels (a field added, a meaning changed).
"""

from dataclasses import field

from kvrelay.shared.wire.limits import ABSENT

PROTOCOL_VERSION = 1
MAX_VERSION_GAP = 1


def protocol_field():
    """A message's ``protocol``: this process's version when it builds the message; 0 when the field is
    missing on the wire (a peer from before versions were sent)."""
    return field(default=PROTOCOL_VERSION, metadata={ABSENT: 0})


def version_refusal(peer_version: int, who: str) -> str:
    """Why ``who``, speaking ``peer_version``, is refused; "" when it is close enough to ours."""
    if abs(peer_version - PROTOCOL_VERSION) <= MAX_VERSION_GAP:
        return ""
    return (f"{who} speaks wire protocol {peer_version}, this process {PROTOCOL_VERSION}: more than "
            f"{MAX_VERSION_GAP} version apart, refused (upgrade one version at a time)")
