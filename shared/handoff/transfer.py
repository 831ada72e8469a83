"""One KV transfer as the prefill side tracks it: the request, where its KV goes, and the state it is in
(states.py names every state and event; ``to`` refuses an illegal step)."""

import time
from dataclasses import dataclass, field

from kvrelay.shared.handoff.base import KVSender
from kvrelay.shared.handoff.states import Event, State, next_state
from kvrelay.shared.wire.handoff import HandoffGrant, KVHeader
from kvrelay.shared.wire.protocol import Job


@dataclass
class FirstToken:
    """What the prefill sampled, carried to the decode side in the header."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list | None = None
    num_cached_tokens: int = 0


@dataclass
class Transfer:
    job: Job
    entry_id: bytes
    first: FirstToken | None = None  # None while an early ask's prompt is not computed yet
    state: State = State.NEW
    target: str = ""  # the decode worker's address
    target_id: str = ""  # and its worker id (what the gateway knows it by)
    tried: set[str] = field(default_factory=set)
    rounds_refused: int = 0  # rounds in a row no decode worker took it (a grant resets it): how long it waits next
    waits_for_room: bool = False  # the last refusal was for lack of room: it may wait past the handoff timeout
    # that refusal was its tenant's KV quota on the decode worker (HandoffGrant.over_quota), not a full batch
    waits_for_quota: bool = False
    seat_wait_from: float = 0.0  # perf_counter when a refusal for lack of room made the prefilled KV wait
    seat_wait_s: float = 0.0  # how long it waited for a decode seat, once it got one (or failed)
    grant: HandoffGrant | None = None
    ask: int = 0  # the number of its latest HandoffRequest (HandoffRequest.ask): only its answer is taken
    asked_at: float = 0.0  # monotonic time of the last HandoffRequest
    # the hash chain its asks offer (HandoffRequest.block_hashes), worked out once for all its asks; None: not yet
    block_hashes: list[int] | None = None
    deadline: float = 0.0
    sender: KVSender | None = None  # while the KV moves
    header: KVHeader | None = None  # once the first token is known and the KV moves
    holds_source: bool = False  # our prefill blocks are still held for this transfer
    streamed: bool = False  # the KV left layer by layer during the prompt's last chunk
    transport: str = ""  # the sender's, for metrics
    nbytes: int = 0
    reason: str = ""  # why it failed
    # it failed because its decode worker left the registry (died, or shut down) before admitting it:
    # nothing holds the request, so the prefill side may run it again (sender.py ``target_gone``)
    target_lost: bool = False
    started: float = field(default_factory=time.perf_counter)  # perf_counter stamps, for logs and the benchmark
    granted: float = 0.0
    sent: float = 0.0
    ended: float = 0.0

    @property
    def computed(self) -> bool:
        return self.first is not None

    def to(self, event: Event) -> None:
        self.state = next_state(self.state, event)

    def wait_for_seat(self, over_quota: bool = False) -> None:
        """Refused for lack of room (``over_quota``: its tenant's): the prefilled KV waits for a decode seat from
        now (if not already)."""
        self.waits_for_quota = over_quota
        if not self.seat_wait_from:
            self.seat_wait_from = time.perf_counter()

    def seat_found(self) -> None:
        """A grant came (or the transfer ended): its wait for a seat, if any, is over."""
        if self.seat_wait_from:
            self.seat_wait_s += time.perf_counter() - self.seat_wait_from
            self.seat_wait_from = 0.0
