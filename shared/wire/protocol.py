"""Every message of the request path and the model registry that crosses a process boundary, defined
once: gateway -> prefill stream (Job), worker -> gateway (TokenBatch of TokenEvents), gateway -> workers
(Abort), workers -> Redis (WorkerInfo, ModelInfo), gateway -> workers (ModelSpec, ControlCommand/Result).
The KV handoff's messages are in handoff.py; both go through codec.py (msgpack, never pickle).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from kvrelay.shared.wire.codec import register
from kvrelay.shared.wire.engine_stats import EngineStats
from kvrelay.shared.wire.limits import ABSENT, IGNORABLE, MAX_ID_LEN
from kvrelay.shared.wire.sampling_params import SamplingParams
from kvrelay.shared.wire.version import PROTOCOL_VERSION, protocol_field

FINISH_REASONS = ("stop", "length", "abort", "error")
WORKER_ROLES = ("prefill", "decode", "unified")
INSTANCE_STATES = ("loading", "ready", "draining", "failed")
CONTROL_OPS = ("load", "unload")
SCHEDULING_POLICIES = ("fcfs", "priority")  # --scheduling-policy
KV_CACHE_DTYPES = ("", "auto", "fp8", "fp8_e4m3")  # ModelSpec.kv_cache_dtype ("": the worker's --kv-cache-dtype)
# TokenEvent.first_token_times: the job read from its stream, the start of the engine step that sampled
# the first token, that token sampled, and its event sent at the end of the worker's loop
FIRST_TOKEN_STAMPS = ("fetched", "step_started", "sampled", "flushed")

_ID = {"max_len": MAX_ID_LEN}
# [token_id, logprob] pairs, most likely first.
TopLogprobs = list[tuple[int, float]]


@dataclass
class Job:
    """Gateway -> prefill stream ``kvrelay:prefill:{model}`` (field ``data``), or under the priority policy its
    priority band's (priority_bands.py). Always n=1: the gateway fans ``n`` out into ``{rid}-{i}`` jobs before
    they reach a worker."""

    TAG: ClassVar[str] = "job"
    request_id: str = field(metadata=_ID)
    model: str = field(metadata=_ID)
    prompt_token_ids: list[int]
    sampling: SamplingParams  # checked at the gateway, re-validated on decode; max_tokens resolved to an int
    tenant: str = field(metadata=_ID)
    priority: int
    reply_addr: str  # the gateway's ZMQ PULL address; TokenBatch messages go there
    deadline: float  # unix seconds; a worker drops (finish_reason "abort") what is past it
    arrival: float  # unix seconds, when the gateway accepted the request
    cache_salt: str | None = None
    # the gateway's wire protocol version; one too far apart is refused (job_queue.py). Jobs carried none through
    # protocol 1, so a missing one is 1 and a protocol-1 gateway leaves it off; from 2 on a worker of protocol 1
    # that predates the field drops it as ignorable.
    protocol: int = field(default=PROTOCOL_VERSION, metadata={ABSENT: 1, **IGNORABLE})

    def check(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("Job.prompt_token_ids must not be empty")
        if min(self.prompt_token_ids) < 0:
            raise ValueError("Job.prompt_token_ids must be non-negative")
        if self.sampling.n != 1:
            raise ValueError("Job.sampling.n must be 1 (the gateway fans out n)")


@dataclass
class TokenEvent:
    """One request's progress in one engine step. ``logprobs[i]``/``top_logprobs[i]`` belong to
    ``token_ids[i]``; ``prompt_logprobs`` (position 0 is None) rides on the first event only.

    The first token may come from the prefill worker and the rest from a decode worker, over different
    sockets, so arrival order is not output order: ``output_index`` (how many output tokens came before
    this event's first one) lets the gateway put events back in order and drop duplicates."""

    TAG: ClassVar[str] = "token_event"
    request_id: str = field(metadata=_ID)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    prompt_logprobs: list[TopLogprobs | None] | None = None
    # per prompt position, the rank in the vocabulary (1 = most likely) of each prompt_logprobs entry: the
    # prompt token's true rank first, then 1..k for the best tokens (vLLM's prompt_logprobs shape)
    prompt_logprob_ranks: list[list[int] | None] | None = None
    finish_reason: str | None = field(default=None, metadata={"choices": FINISH_REASONS})
    stop_reason: int | str | None = None  # the stop token id or stop string; None for EOS / length
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    output_index: int = 0
    worker_id: str = field(default="", metadata=_ID)  # the sender, for logs
    # on a request's first token: unix times (FIRST_TOKEN_STAMPS) of its way through the worker, from which
    # the gateway splits its TTFT into stages (gateway/ttft_stages.py); wall clocks, since they cross processes
    first_token_times: dict[str, float] | None = field(default=None, metadata=IGNORABLE)
    # beside them: when the worker issued the read that returned the job (unix seconds), so the gateway can
    # tell the job waiting for the worker's running step from the read itself; a field of its own, which a
    # gateway that does not know it drops, where a new key in first_token_times would be refused
    fetch_asked: float | None = field(default=None, metadata=IGNORABLE)

    def check(self) -> None:
        if self.output_index < 0:
            raise ValueError("TokenEvent.output_index must be non-negative")
        n = len(self.token_ids)
        if self.logprobs is not None and len(self.logprobs) != n:
            raise ValueError(f"TokenEvent.logprobs has {len(self.logprobs)} entries for {n} tokens")
        if self.top_logprobs is not None and len(self.top_logprobs) != n:
            raise ValueError(f"TokenEvent.top_logprobs has {len(self.top_logprobs)} entries for {n} tokens")
        if self.prompt_logprob_ranks is not None:
            lists = self.prompt_logprobs or []
            if len(self.prompt_logprob_ranks) != len(lists) or any(
                    (r is None) != (e is None) or (e is not None and len(r) != len(e))
                    for r, e in zip(self.prompt_logprob_ranks, lists, strict=False)):
                raise ValueError("TokenEvent.prompt_logprob_ranks must match prompt_logprobs entry for entry")
        if self.error is not None and self.finish_reason != "error":
            raise ValueError("TokenEvent.error requires finish_reason 'error'")
        if self.first_token_times is not None and (
                not set(self.first_token_times) <= set(FIRST_TOKEN_STAMPS)
                or not all(type(t) in (int, float) for t in self.first_token_times.values())):
            raise ValueError(f"TokenEvent.first_token_times maps {', '.join(FIRST_TOKEN_STAMPS)} to unix seconds")
        if self.fetch_asked is not None and (type(self.fetch_asked) not in (int, float) or self.first_token_times is None):
            raise ValueError("TokenEvent.fetch_asked is unix seconds, on an event with first_token_times")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class TokenBatch:
    """Worker -> gateway: every event for one gateway from one engine step, in one ZMQ message."""

    TAG: ClassVar[str] = "token_batch"
    events: list[TokenEvent]


@dataclass
class Abort:
    """Gateway -> every worker, published on ``ABORT_CHANNEL``: stop these requests, free their blocks."""

    TAG: ClassVar[str] = "abort"
    request_ids: list[str]
    reason: str = ""


@dataclass
class RankStatus:
    """One rank of a tensor- or pipeline-parallel model instance: its process, its device, its shard."""

    TAG: ClassVar[str] = "rank_status"
    rank: int
    pid: int
    device: str = field(metadata={"max_len": 32})
    weight_bytes: int = 0  # this rank's shard (pipeline stage) of the weights


@dataclass
class InstanceStatus:
    """One model instance (a model at one version) inside a worker, as its heartbeat reports it."""

    TAG: ClassVar[str] = "instance_status"
    instance: str = field(metadata=_ID)  # instance_key(name, version): the stream / handoff identity
    name: str = field(metadata=_ID)  # what clients ask for
    version: int  # 0: not from the repository (a path given to the worker)
    state: str = field(metadata={"choices": INSTANCE_STATES})
    weight_bytes: int = 0
    kv_blocks: int = 0  # owned from the worker's shared KV pool
    kv_free_blocks: int = 0
    running: int = 0
    waiting: int = 0  # in the engine plus jobs this worker holds but has not admitted
    idle_s: float = field(default=0.0, metadata=IGNORABLE)  # since the last request ended or arrived
    pinned: bool = False
    load_s: float = 0.0  # how long its load took: the reload cost eviction weighs
    error: str = ""  # why a load failed (state "failed")
    # its engine's vLLM series, relayed by the gateway's /metrics (a gateway without them relays fewer)
    engine: EngineStats | None = field(default=None, metadata=IGNORABLE)
    # one placement on tensor_parallel_size x pipeline_parallel_size devices; weight_bytes above is what it
    # counts against the worker's weights budget (shared/worker/model_memory.py group_weight_bytes)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    ranks: list[RankStatus] = field(default_factory=list, metadata=IGNORABLE)  # rank 0 (this worker's process) first
    # what it keeps besides weights and KV while loaded (graphs, buffers), and its largest step's temporaries: the
    # worker counts both against its budget (shared/worker/load_room.py); a gateway predating them drops them
    overhead_bytes: int = field(default=0, metadata=IGNORABLE)
    step_peak_bytes: int = field(default=0, metadata=IGNORABLE)


@dataclass
class WorkerInfo:
    """Heartbeat record at ``worker_key(worker_id)`` (TTL'd); its id is in ``WORKERS_INDEX``."""

    TAG: ClassVar[str] = "worker_info"
    worker_id: str = field(metadata=_ID)
    role: str = field(metadata={"choices": WORKER_ROLES})
    models: list[str]  # instance keys that are ready to serve
    zmq_addr: str
    free_blocks: int
    total_blocks: int
    running: int
    waiting: int
    pid: int
    host: str
    started: float  # unix seconds
    heartbeat: float  # unix seconds of this record
    instances: list[InstanceStatus] = field(default_factory=list)
    weights_budget: int = 0  # bytes this worker's models may take besides KV (0: unknown / no loading)
    weights_used: int = 0  # of it, by their weights
    # of it, by the rest: each model's resident overhead and one step peak held back. Placement ranks workers by
    # what is left after both; a gateway predating it ranks by weights alone (the worker still refuses what
    # does not fit)
    overhead_used: int = field(default=0, metadata=IGNORABLE)
    # the KV pool's bytes, shown by /admin/models only: a gateway that does not know one may ignore it
    kv_pool_bytes: int = field(default=0, metadata=IGNORABLE)  # the pool's configured size (--kv-cache-memory)
    # not owned by any model, or free and above a model's floor (reclaimable)
    kv_free_bytes: int = field(default=0, metadata=IGNORABLE)
    # backed by memory now: grows into unused weights budget, shrinks for loads
    kv_committed_bytes: int = field(default=0, metadata=IGNORABLE)
    # the most it may commit now: its size plus the weights budget no weights use
    kv_cap_bytes: int = field(default=0, metadata=IGNORABLE)
    can_load: bool = False  # has a model repository and takes ControlCommands
    protocol: int = protocol_field()  # the worker's wire protocol version (shared/wire/version.py)
    # seconds its engine loop has been in one turn (a step), as of ``heartbeat``; 0 between turns and while the
    # loop waits for a turn another thread (a model load) holds. The heartbeat does not wait for steps, so this is
    # how a gateway tells a stuck loop from a live one (gateway/control/stalled_workers.py); a gateway that does
    # not know it routes as before
    step_age_s: float = field(default=0.0, metadata=IGNORABLE)

    @property
    def can_prefill(self) -> bool:
        return self.role in ("prefill", "unified")

    @property
    def can_decode(self) -> bool:
        return self.role in ("decode", "unified")


@dataclass
class ModelInfo:
    """Published by a worker that loaded a model, at ``model_key(name)``; name is in ``MODELS_INDEX``."""

    TAG: ClassVar[str] = "model_info"
    name: str = field(metadata=_ID)
    path: str  # model directory holding the tokenizer files
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    block_size: int
    dtype: str

    served_name: str = field(default="", metadata=_ID)  # the client-facing name; "" = ``name``
    version: int = 0
    # the worker's --scheduling-policy: a request's ``priority`` orders admission only under "priority", so the
    # gateway refuses one elsewhere instead of accepting and ignoring it; a gateway predating it drops it
    scheduling_policy: str = field(default="fcfs", metadata={"choices": SCHEDULING_POLICIES, **IGNORABLE})

    def check(self) -> None:
        if self.max_model_len < 1 or self.vocab_size < 1:
            raise ValueError("ModelInfo.max_model_len and vocab_size must be positive")


@dataclass
class ModelSpec:
    """A registered model: the desired state at ``registry_key(name)`` (name in ``REGISTRY_INDEX``).
    Written by the admin API and ``kvrelay serve``; workers load and unload toward it."""

    TAG: ClassVar[str] = "model_spec"
    name: str = field(metadata=_ID)
    version: int = 0  # the active version in the repository; 0: ``path`` names the model
    path: str = ""  # only for version 0: a directory or .gguf the operator configured (never from the API)
    dtype: str = "auto"
    quantization: str = ""  # fp8 | int8 | awq | gptq; "": the worker's --quantization, else the checkpoint's
    # what its KV cache stores: auto | fp8 | fp8_e4m3; "": the worker's --kv-cache-dtype. Both roles load a
    # model from the same spec, so a disaggregated pair agrees on it
    kv_cache_dtype: str = field(default="", metadata={"choices": KV_CACHE_DTYPES})
    max_model_len: int = 0  # 0: the model's own
    pinned: bool = False  # never evicted, loaded at registration
    min_replicas: int = 0  # workers per role that keep it loaded even when idle
    keep_alive_s: float = 0.0  # unload after this long idle (0: until evicted for room)
    previous_version: int = 0  # during a swap: the version still draining
    updated: float = 0.0

    @property
    def instance(self) -> str:
        return instance_key(self.name, self.version)


@dataclass
class ControlCommand:
    """LPUSHed to ``control_key(worker_id)``; the worker answers at ``control_result_key(command_id)``."""

    TAG: ClassVar[str] = "control_command"
    command_id: str = field(metadata=_ID)
    op: str = field(metadata={"choices": CONTROL_OPS})
    name: str = field(metadata=_ID)
    version: int = 0
    path: str = ""  # version 0 only: must be one the worker was configured with
    dtype: str = "auto"
    quantization: str = ""  # as ModelSpec.quantization
    kv_cache_dtype: str = field(default="", metadata={"choices": KV_CACHE_DTYPES})  # as ModelSpec's
    max_model_len: int = 0
    pinned: bool = False
    keep_alive_s: float = 0.0
    drain: bool = True  # unload: finish what is queued and in flight first (a swap's old version)
    evict: bool = True  # load: may unload idle unpinned models to make room
    prefer_evict: list[str] = field(default_factory=list)  # instances to evict first: what the other role
    # evicted for this load, so both roles drop the same model instead of half-serving two
    waiting: int = 0  # load: requests waiting for it now, as the gateway counts them (its demand, eviction.py)

    @property
    def instance(self) -> str:
        return instance_key(self.name, self.version)


@dataclass
class ControlResult:
    TAG: ClassVar[str] = "control_result"
    command_id: str = field(metadata=_ID)
    worker_id: str = field(metadata=_ID)
    instance: str = field(metadata=_ID)
    ok: bool
    error: str = ""
    seconds: float = 0.0
    evicted: list[str] = field(default_factory=list)  # instances unloaded to make room


def instance_key(name: str, version: int) -> str:
    """The identity of one model version in streams, handoffs and heartbeats."""
    return f"{name}@{version}" if version else name


MESSAGE_TYPES: tuple[type, ...] = (Job, TokenEvent, TokenBatch, Abort, WorkerInfo, ModelInfo, RankStatus,
                                   InstanceStatus, ModelSpec, ControlCommand, ControlResult)
register(*MESSAGE_TYPES)
