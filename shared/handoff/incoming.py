"""A transfer whose KV is arriving (or, written directly, has arrived) in a decode worker's granted blocks: the
``KVReceiver`` (base.py) its transport gets for this worker's cache, and the header, which comes last and
carries the first token, checked against the grant and the cache's layout."""

from collections.abc import Callable
from dataclasses import dataclass, field

from kvrelay.shared.engine.kv_connector import EngineKV
from kvrelay.shared.handoff.base import KVReceiver, Transport
from kvrelay.shared.handoff.blocks import check_layout
from kvrelay.shared.handoff.grants import Grant
from kvrelay.shared.handoff.rank_parts import RankParts
from kvrelay.shared.handoff.sharded import ByRankReceiver, ImportingReceiver
from kvrelay.shared.wire.handoff import KVHeader


@dataclass
class Incoming:
    peer: bytes
    requester: str
    model: str
    block_ids: list[int]
    num_tokens: int
    transport: str
    receiver: KVReceiver
    ttl_s: float  # the grant's: no progress for this long fails the transfer
    deadline: float
    since: float  # monotonic time its grant was made
    epoch: int  # its grant's: KV of any other grant of the request is dropped
    header: KVHeader | None = None  # the last message: once here and the receiver complete, it lands
    tenant: str = ""  # its grant's: whose KV quota its blocks count against
    reused: list[int] = field(default_factory=list)  # its grant's: the prompt's leading blocks held here already
    block_hashes: list[int] = field(default_factory=list, repr=False)  # its grant's: cached here once it lands

    @classmethod
    def of(cls, grant: Grant, transport: str, receiver: KVReceiver, now: float) -> "Incoming":
        return cls(grant.peer, grant.requester, grant.model, grant.block_ids, grant.num_tokens, transport, receiver,
                   grant.ttl_s, now + grant.ttl_s, grant.since, grant.epoch, tenant=grant.tenant, reused=grant.reused,
                   block_hashes=grant.block_hashes)


def receiver_for(kv: EngineKV, rid: str, grant: Grant, transport: str, by_name: dict[str, Transport],
                 on_done: Callable[..., None]) -> KVReceiver:
    """The receiver of ``grant``'s KV over ``transport`` (one of ``by_name``); ValueError when it cannot be taken."""
    if transport not in by_name:
        raise ValueError(f"KV over {transport!r}, which this worker does not take")
    chosen = by_name[transport]
    if kv.sharded and chosen.writes_directly:
        raise ValueError(f"KV over {transport!r} into parallel ranks; they take frames only")
    if kv.receives_by_rank(rid) and transport == RankParts.name:
        return ByRankReceiver(kv, rid, grant.block_ids, on_done)
    if kv.sharded:
        kv.drop_parts(rid)  # the KV comes another way, to rank 0
        return ImportingReceiver(kv, grant.block_ids, chosen, grant.offered, on_done, grant.frames_key)
    return chosen.receiver(kv.kv_cache, grant.block_ids, grant.offered, on_done, grant.frames_key)


def check_header(header: KVHeader, payload: list, inc: Incoming, kv: EngineKV) -> None:
    """ValueError unless ``header`` (which carries no frames) ends ``inc``'s transfer: its blocks, model,
    transport, prompt and layout."""
    if header.block_ids != inc.block_ids or header.model != inc.model:
        raise ValueError("KV addressed to blocks that were not granted")
    if header.transport != inc.transport or payload:
        raise ValueError(f"a {header.transport!r} header after {inc.transport!r} KV")
    if len(header.job.prompt_token_ids) != inc.num_tokens:
        raise ValueError("prompt length differs from the granted one")
    if header.cached_blocks != len(inc.reused):
        raise ValueError(f"the header says {header.cached_blocks} blocks were held here, the grant {len(inc.reused)}")
    # the reused blocks were matched by a 64-bit hash of the ask, which anyone may forge or a collision may meet:
    # they are this prompt's only if their stored tokens are the header's, or the request would decode on another's KV
    job = header.job
    if inc.reused and not kv.holds_prefix(inc.reused, job.prompt_token_ids, job.tenant, job.cache_salt):
        raise ValueError("the blocks held here for the prompt's leading KV hold another prompt's")
    check_layout(kv.kv_cache, header, kv.num_kv_heads, kv.num_layers)
