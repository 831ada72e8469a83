"""Rank 0 -> the other ranks of a tensor-parallel group: what each step asks of every model shard.

One socket per rank carries these in order (shared/engine/ranks/broadcast.py). A ``RankStep`` is followed
by one raw frame, the step's packed int32 inputs (shared/engine/step_inputs.py ``Layout``): the rank
rebuilds the same tensors rank 0 runs on, without a per-step encoding of every list. The other way, a decode
group's ranks report to rank 0 where they take their shares of arriving KV and when each share is in
(``RankInletHello``, ``RankKVDone``; shared/engine/ranks/kv_inlet.py).
"""

from dataclasses import dataclass, field
from typing import ClassVar

from kvrelay.shared.wire.codec import register
from kvrelay.shared.wire.handoff import MAX_TARGETS, KVTarget
from kvrelay.shared.wire.limits import MAX_ID_LEN

_ID = {"max_len": MAX_ID_LEN}
_ADDR = {"max_len": 1024}  # a peer's ZMQ address (an ipc:// path may be long)

# which logits a step computes: none (a mid-prompt chunk), the sampled rows, or every row (prompt logprobs)
LOGITS_NONE, LOGITS_SAMPLED, LOGITS_ALL = 0, 1, 2


@dataclass
class RankAlloc:
    """Allocate the KV cache: ``num_blocks`` device blocks (rank 0's count) and swap space on the host."""

    TAG: ClassVar[str] = "rank_alloc"
    num_blocks: int
    num_host_blocks: int

    def check(self) -> None:
        if self.num_blocks < 1 or self.num_host_blocks < 0:
            raise ValueError("RankAlloc: num_blocks must be positive, num_host_blocks non-negative")


@dataclass
class RankProfile:
    """CUDA: run the activation-peak forward of ``num_tokens`` tokens, then agree on the KV blocks that fit."""

    TAG: ClassVar[str] = "rank_profile"
    num_tokens: int
    num_rows: int  # rows whose logits are computed
    max_len: int = 0  # the longest prompt the forward may hold (the model's max_model_len); 0: one prompt

    def check(self) -> None:
        if min(self.num_tokens, self.num_rows) < 1:
            raise ValueError("RankProfile sizes must be positive")


@dataclass
class RankSwap:
    """Copy KV blocks out to host swap space and back, before the step that needs them."""

    TAG: ClassVar[str] = "rank_swap"
    swap_out: list[list[int]]  # [device block, host block]
    swap_in: list[list[int]]  # [host block, device block]

    def check(self) -> None:
        if any(len(pair) != 2 or min(pair) < 0 for pair in self.swap_out + self.swap_in):
            raise ValueError("RankSwap pairs are two non-negative block ids")


@dataclass
class RankStep:
    """One forward: the sizes of the packed inputs in the next frame, and which logits to form."""

    TAG: ClassVar[str] = "rank_step"
    num_tokens: int
    num_seqs: int
    width: int  # block-table columns
    num_sample_rows: int
    max_query_len: int
    max_seq_len: int
    logits: int
    # a pipeline's step split into this many micro-batches: their RankSteps follow one another at once,
    # so each stage can take them all before it runs the first (pipe_step.py)
    micro_batches: int = 1
    # async scheduling: decode rows whose input id rank 0 sampled a step ago and has not read on its host; their
    # row indices follow the packed inputs in the frame, their ids come in a broadcast from rank 0 (driver_step.py)
    num_fed: int = 0

    def check(self) -> None:
        if min(self.num_tokens, self.num_seqs, self.width, self.max_query_len, self.max_seq_len,
               self.micro_batches) < 1:
            raise ValueError("RankStep sizes must be positive")
        if not 0 <= self.num_fed <= self.num_tokens:
            raise ValueError("RankStep.num_fed must be within the step's tokens")
        if not 0 <= self.num_sample_rows <= self.num_tokens:
            raise ValueError("RankStep.num_sample_rows must be within the step's tokens")
        if self.logits not in (LOGITS_NONE, LOGITS_SAMPLED, LOGITS_ALL):
            raise ValueError(f"RankStep.logits must be {LOGITS_NONE}, {LOGITS_SAMPLED} or {LOGITS_ALL}")


@dataclass
class RankKVExport:
    """Gather this rank's KV heads of ``block_ids`` (every layer) to rank 0, in one collective: a prefill's
    KV leaving for another worker."""

    TAG: ClassVar[str] = "rank_kv_export"
    block_ids: list[int]

    def check(self) -> None:
        if not self.block_ids or min(self.block_ids) < 0:
            raise ValueError("RankKVExport.block_ids must be non-empty, non-negative")


@dataclass
class RankKVImport:
    """Take this rank's KV heads of ``block_ids`` (every layer) from rank 0, in one collective, and write
    them into those blocks: KV handed over by another worker."""

    TAG: ClassVar[str] = "rank_kv_import"
    block_ids: list[int]

    def check(self) -> None:
        if not self.block_ids or min(self.block_ids) < 0:
            raise ValueError("RankKVImport.block_ids must be non-empty, non-negative")


@dataclass
class RankKVSend:
    """Send this rank's part of ``block_ids`` (its stage's layers, its KV heads of them) to the decode worker
    at ``peer`` as KVLayers parts of ``request_id``, from this rank's own socket (shared/engine/ranks/
    kv_parts.py). A replica of heads an earlier rank holds sends nothing. Rank 0 keeps the transfer's control
    (grant, header, ack); ``deadline_s``: how long a part may wait for room on the socket before it is dropped
    (the decode side then fails the transfer for the missing part)."""

    TAG: ClassVar[str] = "rank_kv_send"
    request_id: str = field(metadata=_ID)
    block_ids: list[int]
    peer: str = field(metadata=_ADDR)
    requester: str = field(metadata=_ID)
    deadline_s: float
    # the grant's decode ranks (HandoffGrant.targets): each gets the (layer, head)s of this rank's part it
    # holds, at its own address ("" = ``peer``); empty: the whole part to ``peer``
    targets: list[KVTarget] = field(default_factory=list)
    epoch: int = 0  # the grant's (HandoffGrant.epoch), stamped on every part

    def check(self) -> None:
        if not self.block_ids or min(self.block_ids) < 0:
            raise ValueError("RankKVSend.block_ids must be non-empty, non-negative")
        if len(self.targets) > MAX_TARGETS:
            raise ValueError(f"RankKVSend carries at most {MAX_TARGETS} targets")
        if not self.peer.startswith(("tcp://", "ipc://")):
            raise ValueError("RankKVSend.peer must be a tcp:// or ipc:// address")
        if not 0.0 < self.deadline_s < float("inf"):
            raise ValueError("RankKVSend.deadline_s must be a positive number of seconds")


@dataclass
class RankKVExpect:
    """A sharded decode worker granted ``block_ids`` to ``requester``'s ``request_id``: this rank takes its own
    layers and heads of the transfer on its inlet socket (shared/engine/ranks/kv_inlet.py) and reports them
    done to rank 0 (``RankKVDone``). Parts of any other grant ``epoch`` of the request are not taken for it."""

    TAG: ClassVar[str] = "rank_kv_expect"
    request_id: str = field(metadata=_ID)
    requester: str = field(metadata=_ID)
    block_ids: list[int]
    epoch: int = 0  # the grant's (HandoffGrant.epoch)

    def check(self) -> None:
        if not self.block_ids or min(self.block_ids) < 0:
            raise ValueError("RankKVExpect.block_ids must be non-empty, non-negative")


@dataclass
class RankKVDrop:
    """Forget an expected transfer (cancelled, failed, expired, or arriving another way): its blocks go back. Only
    its grant ``epoch`` and earlier ones: parts of a later grant of the request, come early, stay parked."""

    TAG: ClassVar[str] = "rank_kv_drop"
    request_id: str = field(metadata=_ID)
    epoch: int = 0


@dataclass
class RankInletHello:
    """A decode rank -> rank 0, once: the address its inlet socket listens on."""

    TAG: ClassVar[str] = "rank_inlet_hello"
    rank: int
    address: str = field(metadata=_ADDR)

    def check(self) -> None:
        if self.rank < 1 or not self.address.startswith(("tcp://", "ipc://")):
            raise ValueError("RankInletHello: a rank >= 1 and a tcp:// or ipc:// address")


@dataclass
class RankKVDone:
    """A decode rank -> rank 0: its share of ``request_id`` is in its blocks, every layer CRC-checked (``ok``),
    or failed (``reason``); ``nbytes``: the KV bytes it took; ``epoch``: the grant's it expected (a report on an
    earlier grant of the request, read after it was granted again, is not one on this grant)."""

    TAG: ClassVar[str] = "rank_kv_done"
    rank: int
    request_id: str = field(metadata=_ID)
    ok: bool
    nbytes: int = 0
    reason: str = field(default="", metadata={"max_len": 1024})
    epoch: int = 0


@dataclass
class RankStop:
    """The group is shutting down: exit."""

    TAG: ClassVar[str] = "rank_stop"


RankMessage = (RankAlloc | RankProfile | RankSwap | RankStep | RankKVExport | RankKVImport | RankKVSend | RankKVExpect
               | RankKVDrop | RankStop)

register(RankAlloc, RankProfile, RankSwap, RankStep, RankKVExport, RankKVImport, RankKVSend, RankKVExpect, RankKVDrop,
         RankStop, RankInletHello, RankKVDone)
