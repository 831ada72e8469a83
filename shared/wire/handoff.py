"""The KV handoff's messages (prefill <-> decode over ZMQ): ask, grant, KV, cancel, ack.

    prefill                                decode
    HandoffRequest  ----------------->     blocks allocated before accepting
                    <-----------------     HandoffGrant (block ids; a KVIpcHandle on the same GPU)
    KVLayers + frame, ... (or an IPC write)
    KVHeader (first token) ----------->    checked, admitted
                    <-----------------     HandoffAck (the prefill side may XACK)
    HandoffCancel: a grant the asker will not use.

Every grant has an epoch, unique on its decode worker; the KV and the header sent for it, and the ack
answering them, carry it. A request id granted again (to the same asker, after a cancel or a failure) gets a
new one, so a part of the old grant still in flight is told from the new grant's and dropped. Every ask of a
transfer has its number, which the grant (or refusal) answering it echoes: a late answer to an earlier ask
(the asker has since asked again, there or elsewhere) is not taken for the answer to the latest, and a grant
in it is given back (HandoffCancel), or it would hold a seat.

Encoded by shared/wire/codec.py, like every other message; raw KV bytes never go through
msgpack, they follow a KVLayers message as their own ZMQ frame.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from kvrelay.shared.wire.codec import register
from kvrelay.shared.wire.limits import IGNORABLE, MAX_MAP_LEN
from kvrelay.shared.wire.protocol import _ID, Job, TopLogprobs
from kvrelay.shared.wire.version import protocol_field

_IGNORABLE_ID = {**_ID, **IGNORABLE}
# block hashes an ask carries at most (its prompt's leading blocks past them are granted as usual): a step's
# MAX_ASKS asks then stay far inside MAX_MESSAGE_BYTES (a hash packs in 9 bytes)
MAX_BLOCK_HASHES = 4096


@dataclass
class HandoffRequest:
    """Prefill -> decode: asks the decode worker to reserve blocks for a prompt's KV, once its prefill
    finished or, early, before it runs (so its layers can stream while the last chunk computes)."""

    TAG: ClassVar[str] = "handoff_request"
    request_id: str = field(metadata=_ID)
    model: str = field(metadata=_ID)
    num_tokens: int
    block_size: int
    # CUDA IPC offer: the asker's GPU UUID ("" = no CUDA) and worker id (one IPC export per asker, so
    # torch's per-consumer reference count on the decode's KV allocation stays exact). Ignorable: a decode
    # worker that does not take the offer grants without IPC, and the KV goes as frames
    device_uuid: str = field(default="", metadata=_IGNORABLE_ID)
    requester: str = field(default="", metadata=_ID)
    # seconds the asker may take to use a grant (it reads replies only between its engine steps): the
    # decode side keeps the grant at least this long, within its own bound (shared/handoff/grant_hold.py).
    # Ignorable: a grant that lapses first is refused when used, and the asker asks again
    hold_s: float = field(default=0.0, metadata=IGNORABLE)
    # what the asker's KV cache stores ("bfloat16", "float8_e4m3fn", ...; "" = not said): a decode worker
    # whose cache stores another dtype refuses before any byte moves, rather than misread them
    kv_dtype: str = field(default="", metadata=_ID)
    # an fp8 cache's per-layer K/V scales, digested (shared/engine/kv_scales.py; "" = not said): the same bytes
    # under other scales are other values, refused like another dtype. Must be understood: a decode worker that
    # cannot check scales refuses the ask rather than take KV it would misread
    kv_scales: str = field(default="", metadata=_ID)
    # which of its transfer's asks this is (they count up from 1; 0 = not numbered): the grant or refusal
    # answering it echoes it, so the asker, which may have asked again elsewhere since, knows which ask it
    # answers. Ignorable: the asker takes an answer without it (0) for the answer to its latest ask there
    ask: int = field(default=0, metadata=IGNORABLE)
    # the job's tenant, for the decode worker's --tenant-kv-quota (decode_worker/tenant_quota.py; "" = not said:
    # no quota applies). Ignorable: a decode worker that enforces no quota there grants as ever
    tenant: str = field(default="", metadata=_IGNORABLE_ID)
    # asked before the prompt is prefilled (so its KV can stream during the last chunk): refused, the asker parks
    # it and asks again once prefilled, so until then it takes no place in its tenant's quota line there.
    # Ignorable: such an ask is refused like any other
    early: bool = field(default=False, metadata=IGNORABLE)
    # the hash chain (shared/wire/block_hash.py) of the prompt's leading full blocks in its cache namespace: the
    # decode worker grants only the blocks past those it already holds (HandoffGrant.cached_blocks). Sent only
    # by an unsharded sender. Ignorable: a decode worker that does not reuse KV grants every block, as ever
    block_hashes: list[int] = field(default_factory=list, metadata=IGNORABLE)
    # the job's gateway (Job.reply_addr): the decode worker opens its event connection there when it grants, so
    # that the first event it sends after the KV lands does not wait on a TCP and CURVE handshake that its ack
    # does not wait on (shared/wire/rerun.py). Ignorable: the connection opens with the first event, as ever
    reply_addr: str = field(default="", metadata=_IGNORABLE_ID)
    protocol: int = protocol_field()  # the asker's wire protocol version: one too far apart is refused

    def check(self) -> None:
        if self.num_tokens < 1 or self.block_size < 1:
            raise ValueError("HandoffRequest.num_tokens and block_size must be positive")
        if len(self.block_hashes) > min(MAX_BLOCK_HASHES, self.num_tokens // self.block_size):
            raise ValueError("HandoffRequest.block_hashes: more hashes than the prompt has full blocks (or "
                             f"over {MAX_BLOCK_HASHES})")
        if any(not 0 <= h < 1 << 64 for h in self.block_hashes):
            raise ValueError("HandoffRequest.block_hashes must be 64-bit unsigned")
        if not 0.0 <= self.hold_s < float("inf"):
            raise ValueError("HandoffRequest.hold_s must be a finite number of seconds >= 0")


FRAME_KEY_BYTES = FRAME_MAC_BYTES = 32  # HMAC-SHA256's (shared/engine/kv_frame.py)
MAX_ASKS = 256  # HandoffRequests / HandoffGrants per message: a step finishes at most max-num-seqs prompts


@dataclass
class HandoffRequests:
    """Prefill -> decode: the asks of one engine step for one decode worker in one message, answered by
    one HandoffGrants; each message is a receive, a CURVE decryption and a pass of the decode loop."""

    TAG: ClassVar[str] = "handoff_requests"
    requests: list[HandoffRequest]

    def check(self) -> None:
        if not 1 <= len(self.requests) <= MAX_ASKS:
            raise ValueError(f"HandoffRequests must carry 1..{MAX_ASKS} requests")


@dataclass
class KVIpcHandle:
    """The decode worker's whole KV cache tensor, shared through CUDA IPC: the fields of torch's
    ``UntypedStorage._share_cuda_()`` as plain bytes/ints (never torch's pickling reducers), plus the
    tensor's view so the opener can check the layout before writing a byte. Only inside a grant."""

    device_uuid: str = field(metadata=_ID)
    handle: bytes  # cudaIpcMemHandle of the allocation holding the storage (as torch serializes it)
    storage_size: int  # bytes
    storage_offset: int  # bytes, of the storage inside that allocation
    ref_counter: bytes  # name of torch's shared-memory reference-count file
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool
    tensor_offset: int  # elements, of the KV cache tensor inside the storage
    shape: list[int]
    stride: list[int]
    dtype: str

    def check(self) -> None:
        if not 0 < len(self.handle) <= 256 or len(self.ref_counter) > 256:
            raise ValueError("KVIpcHandle: handle sizes out of range")
        if len(self.shape) != 6 or len(self.stride) != 6 or min(self.shape) < 1 or min(self.stride) < 1:
            raise ValueError("KVIpcHandle: shape/stride must be 6 positive ints ([L, 2, N, bs, Hkv, D])")
        if min(self.storage_size, self.storage_offset, self.ref_counter_offset, self.tensor_offset) < 0:
            raise ValueError("KVIpcHandle: sizes and offsets must be non-negative")


@dataclass
class KVTarget:
    """Where a sharded sender's ranks send one decode rank's share of a "rank_layers" transfer: the model's
    layers ``layers`` = [start, end) and KV heads ``heads`` = [first, count] that rank holds, at ``address``
    (its own socket; "" = the grant's, the decode worker's rank 0). Only inside a grant."""

    address: str = field(metadata={"max_len": 1024})
    layers: list[int]
    heads: list[int]

    def check(self) -> None:
        if self.address and not self.address.startswith(("tcp://", "ipc://")):
            raise ValueError("KVTarget.address must be empty or a tcp:// or ipc:// address")
        if len(self.layers) != 2 or not 0 <= self.layers[0] < self.layers[1]:
            raise ValueError("KVTarget.layers must be [start, end) with start < end")
        if len(self.heads) != 2 or self.heads[0] < 0 or self.heads[1] < 1:
            raise ValueError("KVTarget.heads must be [first, count] with count >= 1")


# bulk sockets a grant names at most (--kv-frame-streams): past a few, more sockets only add I/O threads idle for
# want of cores
MAX_FRAME_STREAMS = 16
MAX_TARGETS = 64  # decode ranks a grant names: a tensor- times pipeline-parallel group's world


@dataclass
class HandoffGrant:
    """Decode -> prefill: the decode side allocated ``block_ids`` (SGLang style) or refused, with why."""

    TAG: ClassVar[str] = "handoff_grant"
    request_id: str = field(metadata=_ID)
    accepted: bool
    block_ids: list[int] = field(default_factory=list)
    reason: str = field(default="", metadata=IGNORABLE)
    # refused for lack of room now (a full batch, no free blocks): the asker keeps its KV and asks again
    busy: bool = False
    # (with ``busy``) refused because the request's tenant holds its --tenant-kv-quota of this decode worker's KV:
    # the asker waits and asks again like for a seat; told apart for its logs and metrics. Ignorable: an asker
    # that does not know it waits as for a seat
    over_quota: bool = field(default=False, metadata=IGNORABLE)
    ipc: KVIpcHandle | None = None  # offered when the asker shares this GPU: write the blocks directly
    ttl_s: float = 0.0  # the grant lapses this long after it was sent; IPC writes must land well inside it
    # a sharded decode worker whose ranks receive their own shares: where a sharded sender's ranks send each
    # decode rank's layers and heads ("rank_layers"); empty: everything to the grant's socket, as ever
    targets: list[KVTarget] = field(default_factory=list)
    # which grant of ``request_id`` this is (>= 1 when accepted): its KV, header and ack carry it
    epoch: int = 0
    # host-staged frames go to the decode worker's plain bulk socket at ``frames_addr`` (and its others, below),
    # each MAC'd under ``frames_key``, this grant's own random key (it travels only here, on the CURVE channel); "":
    # frames go to the grant's socket with CRCs. Ignorable (both go together): an asker that does not know them sends
    # its frames to the grant's socket with CRCs, which the decode worker takes for any grant
    frames_addr: str = field(default="", metadata={"max_len": 1024, **IGNORABLE})
    frames_key: bytes = field(default=b"", repr=False, metadata=IGNORABLE)
    # the decode worker's other bulk sockets (--kv-frame-streams), each taking frames under the same key: a sender
    # deals a transfer's frames across all of ``frames_addrs``, since one socket's connection moves its bytes on one
    # libzmq I/O thread. Ignorable: an asker that does not know it sends every frame to ``frames_addr``, as ever
    more_frames_addrs: list[str] = field(default_factory=list, metadata=IGNORABLE)
    # the ask answered (HandoffRequest.ask, echoed; 0 from a decode worker that does not echo it: the asker then
    # takes it for the answer to its latest ask of this decode worker, as it did before asks were numbered)
    ask: int = field(default=0, metadata=IGNORABLE)
    # the prompt's leading blocks whose KV the decode worker already holds (matched by HandoffRequest.block_hashes):
    # ``block_ids`` are the blocks for the prompt's blocks cached_blocks.., which alone the sender fills. Must be
    # understood (KV sent from block 0 would land in the wrong blocks); only nonzero for an ask carrying hashes
    cached_blocks: int = 0
    protocol: int = protocol_field()  # the decode worker's wire protocol version

    def check(self) -> None:
        if self.cached_blocks < 0 or (self.cached_blocks and not (self.accepted and self.block_ids)):
            raise ValueError("HandoffGrant.cached_blocks must be >= 0, and only with blocks granted to fill")
        if len(self.targets) > MAX_TARGETS:
            raise ValueError(f"HandoffGrant carries at most {MAX_TARGETS} targets")
        if bool(self.frames_addr) != bool(self.frames_key) or len(self.frames_key) not in (0, FRAME_KEY_BYTES):
            raise ValueError(f"HandoffGrant.frames_addr needs a frames_key of {FRAME_KEY_BYTES} bytes, and only it")
        if self.more_frames_addrs and not self.frames_addr or len(self.more_frames_addrs) >= MAX_FRAME_STREAMS:
            raise ValueError(f"HandoffGrant.more_frames_addrs: only beside a frames_addr, {MAX_FRAME_STREAMS} in all")
        if any(not a.startswith(("tcp://", "ipc://")) or len(a) > 1024 for a in self.frames_addrs):
            raise ValueError("HandoffGrant.frames_addr and more_frames_addrs must be tcp:// or ipc:// addresses")

    @property
    def frames_addrs(self) -> list[str]:
        """Every bulk socket this grant's frames may go to (none: they go to the grant's socket with CRCs)."""
        return [self.frames_addr, *self.more_frames_addrs] if self.frames_addr else []


@dataclass
class HandoffGrants:
    """Decode -> prefill: the answers to one HandoffRequests, in its order; an ask the decode worker holds for a
    sibling's KV on its way there (shared/handoff/held_asks.py) is left out and answered later, on its own."""

    TAG: ClassVar[str] = "handoff_grants"
    grants: list[HandoffGrant]

    def check(self) -> None:
        if not 1 <= len(self.grants) <= MAX_ASKS:
            raise ValueError(f"HandoffGrants must carry 1..{MAX_ASKS} grants")


# how a KVHeader's KV travelled: "layers", KVLayers messages of host-staged frames (shared/handoff/frames.py);
# "ipc", written by the sender straight into the granted blocks (shared/handoff/direct.py); "rank_layers",
# KVLayers parts sent by each rank of a tensor- or pipeline-parallel sender, each its own layers and KV heads
# (shared/handoff/rank_parts.py), while the header and the ack stay with its rank 0
KV_TRANSPORTS = ("layers", "ipc", "rank_layers")


@dataclass
class KVHeader:
    """Prefill -> decode, the last message of a KV transfer: the KV is out (every KVLayers message queued,
    or the blocks written through IPC). It carries the Job whole, as the gateway wrote it, and the first
    token: all the decode worker needs to continue the request."""

    TAG: ClassVar[str] = "kv_header"
    job: Job
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    block_ids: list[int]  # the destination blocks from the HandoffGrant, in order
    dtype: str  # torch dtype name without the prefix: "bfloat16", "float32", ...
    transport: str = field(metadata={"choices": KV_TRANSPORTS})
    nbytes: int  # of KV, all layers
    first_token_id: int
    first_logprob: float | None
    first_top_logprobs: TopLogprobs | None
    prompt_logprobs: list[TopLogprobs | None] | None
    num_cached_tokens: int
    epoch: int = 0  # the grant's (HandoffGrant.epoch): a header of another grant of the request is not this one's
    # the grant's (HandoffGrant.cached_blocks): the prompt's leading blocks the decode worker held already, before
    # ``block_ids``. Must be understood; only sent to a decode worker that granted it
    cached_blocks: int = 0

    @property
    def request_id(self) -> str:
        return self.job.request_id

    @property
    def model(self) -> str:
        return self.job.model

    def check(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size) < 1:
            raise ValueError("KVHeader layout fields must be positive")
        if len(self.block_ids) != self.num_blocks:
            raise ValueError(f"KVHeader.block_ids has {len(self.block_ids)} ids for {self.num_blocks} blocks")
        if self.cached_blocks < 0:
            raise ValueError("KVHeader.cached_blocks must be non-negative")
        if (self.cached_blocks + self.num_blocks) * self.block_size < len(self.job.prompt_token_ids):
            raise ValueError("KVHeader: blocks cannot hold the prompt")
        if self.nbytes < 0:
            raise ValueError("KVHeader.nbytes must be non-negative")


@dataclass
class KVLayers:
    """Prefill -> decode, for a "layers" transfer: layers ``first`` .. ``first + len(checksums) - 1`` in
    the one raw frame that follows (``[count, 2, n_blocks, bs, Hkv, D]``, ``nbytes`` per layer), sent as
    soon as they are staged, all before the KVHeader (when streamed, while the prompt's last chunk is
    still computing, before the first token exists)."""

    TAG: ClassVar[str] = "kv_layers"
    request_id: str = field(metadata=_ID)
    first: int
    nbytes: int  # of each layer
    checksums: list[int]  # CRC32 of each layer's bytes
    # a "rank_layers" part: [first, count] of the model's KV heads the frame holds (``[count, 2, n_blocks, bs,
    # heads count, D]``); empty: every head, one sender for the whole transfer ("layers")
    heads: list[int] = field(default_factory=list)
    # a part's sender: the worker id that asked for the grant (its ranks send from sockets of their own, so
    # the decode side matches parts to the grant by this, not by the connection the grant went out on)
    requester: str = field(default="", metadata=_ID)
    # the grant's (HandoffGrant.epoch): a part of an earlier grant of the same request id, still in flight, is
    # dropped rather than taken for this one's
    epoch: int = 0
    # the frame's MAC under the grant's frames_key (shared/engine/kv_frame.py), in place of the checksums (then
    # empty): the frame holds its size over ``nbytes`` layers. Whole-layer frames only, never a rank's part. Must be
    # understood, but only sent for a grant that gave a key, which only a decode worker that checks MACs gives
    mac: bytes = b""

    def check(self) -> None:
        if self.mac and (len(self.mac) != FRAME_MAC_BYTES or self.checksums or self.heads or self.nbytes < 1):
            raise ValueError(f"KVLayers: a MAC of {FRAME_MAC_BYTES} bytes, for whole layers without checksums")
        if self.first < 0 or self.nbytes < 0 or not (self.mac or 1 <= len(self.checksums) <= MAX_MAP_LEN):
            raise ValueError("KVLayers: first and nbytes must be non-negative, with 1..4096 checksums")
        if self.heads and (len(self.heads) != 2 or self.heads[0] < 0 or self.heads[1] < 1 or not self.requester):
            raise ValueError("KVLayers.heads must be [first, count] (count >= 1) of a part naming its requester")

    @property
    def is_part(self) -> bool:
        return bool(self.heads)


@dataclass
class HandoffCancel:
    """Prefill -> decode: the asker will not send the KV of a grant (the request ended at its first
    token, was aborted, or waited so long in the prefill queue that its early grant went stale): free
    the blocks now instead of at the grant's expiry. Any layers already sent are dropped."""

    TAG: ClassVar[str] = "handoff_cancel"
    request_id: str = field(metadata=_ID)
    reason: str = field(default="", metadata=IGNORABLE)
    epoch: int = 0  # the grant given up (HandoffGrant.epoch); 0: whichever the asker holds for the request


@dataclass
class HandoffAck:
    """Decode -> prefill: the KV landed and checked out (``ok``), so the prefill side may XACK."""

    TAG: ClassVar[str] = "handoff_ack"
    request_id: str = field(metadata=_ID)
    ok: bool
    reason: str = field(default="", metadata=IGNORABLE)
    # not ok because the decode worker itself is going down (a rank of its group died): the request was
    # never admitted, so the prefill side runs it again rather than failing it
    worker_down: bool = False
    epoch: int = 0  # the grant's whose KV this answers: an answer to an earlier grant of the request is not this one's


register(HandoffRequest, HandoffRequests, HandoffGrant, HandoffGrants, KVHeader, KVLayers, HandoffCancel, HandoffAck)
