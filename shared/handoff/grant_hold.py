"""How long a grant must stay valid for its asker to use it: the asker reads the decode side's replies
only between its engine steps, so a grant that arrives while a step runs is seen when that step ends.
On a GPU a step is milliseconds and the decode side's TTL (the handoff timeout) is far longer; a host
whose step outlasts that TTL (a CPU prefilling thousands of tokens at once) reads its grants after the
decode side has already taken them back, and the KV that follows finds no grant.

So each ask says how long the asker may take (``HandoffRequest.hold_s``): a few of its longest recent
gaps between two reads of the handoff socket, which is what a reply can wait unread. The decode side
keeps the grant at least that long (bounded there), and the asker still refuses to use a grant older
than half its lifetime (sender.py): that one is cancelled and asked again, with the longer hold the
gap that made it stale has taught.
"""

import time
from collections import deque

GAPS_REMEMBERED = 32  # reads of the socket over which the longest gap counts
HOLD_GAPS = 4  # a reply may wait one gap unread, and an early grant must outlive the forward that uses it


class GrantHold:
    def __init__(self) -> None:
        self._gaps: deque[float] = deque(maxlen=GAPS_REMEMBERED)
        self._last = 0.0

    def polled(self) -> None:
        """The asker reads its replies now."""
        now = time.monotonic()
        if self._last:
            self._gaps.append(now - self._last)
        self._last = now

    @property
    def hold_s(self) -> float:
        """How long a grant asked for now should live, at least (0: no measurement yet)."""
        return round(HOLD_GAPS * max(self._gaps, default=0.0), 3)
