"""A worker process's configuration (prefill, decode or unified): its engine settings, where it
registers and listens, how it drains, and the models it hosts."""

import os
import socket
import uuid
from dataclasses import field
from typing import Literal

from pydantic.dataclasses import dataclass

from kvrelay.shared.config import common, depends, role_settings
from kvrelay.shared.config.declare import CONFIG, ConfigError, ExistingDir, Port, RedisUrl, setting
from kvrelay.shared.config.engine import EngineConfig
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.handoff import MAX_FRAME_STREAMS
from kvrelay.shared.wire.protocol import ModelSpec

MIN_RESIDENCY_S = 15.0
GPU_SM_PERCENT = 50
# the roles that read a setting, where not every role does (shared/config/role_settings.py)
PREFILL, DECODE = ("prefill",), ("decode",)
JOB_READERS = ("prefill", "unified")  # those that read jobs from the model's stream
SHARES_SMS = ("mps", "mps-priority", "green")  # the --gpu-share modes that give a worker a share of the SMs


def check_sm_share(gpu_share: str, option: str) -> None:
    """A share of the SMs (``option``) is only for the modes that apply it: one line naming both flags."""
    if gpu_share not in SHARES_SMS:
        why = "chooses the shares itself" if gpu_share == "auto" else "gives no worker a share of the SMs"
        raise ConfigError(f"argument {option}: only with --gpu-share {', '.join(SHARES_SMS[:-1])} or "
                          f"{SHARES_SMS[-1]} (--gpu-share {gpu_share} {why})")


def _worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(config=CONFIG)
class StartupModel:
    """A model a worker loads before it starts serving (``--model``, or each model of ``--config``)."""

    name: str
    engine: EngineConfig
    tokenizer_dir: str = ""
    version: int = 0
    pinned: bool = False
    keep_alive_s: float = 0.0


@dataclass(config=CONFIG)
class WorkerConfig:
    role: Literal["prefill", "decode", "unified"]
    engine: EngineConfig  # the engine flags every model gets; with --model, also the first model
    redis_url: RedisUrl = common.redis_url()
    model_name: str = ""  # the name clients use (served_model_name) of ``engine``'s model; "" for none
    host: str = setting("127.0.0.1", "bind address of the decode worker's ZMQ sockets and of every worker's "
                        "/metrics (loopback unless configured)")
    # prefill and unified workers bind no ZMQ socket: a prefill worker dials decode workers, nothing dials it
    port: Port = setting(0, "decode: ZMQ port of KV handoffs (0: ephemeral)", roles=DECODE)
    advertise_host: str | None = setting(None, "decode: the address prefill workers dial to reach this worker "
                                         "(default: --host); set it when --host is a wildcard, e.g. to the pod IP "
                                         "or service name", roles=DECODE)
    zmq_secret_file: str | None = common.zmq_secret_file()
    insecure_zmq: bool = common.insecure_zmq()
    zmq_secret: str | None = common.zmq_secret()
    encrypt_kv_frames: bool = setting(
        False, "decode: host-staged KV frames come encrypted on the CURVE socket (for networks between hosts that "
        "are not trusted; ~1/3 the unencrypted speed on a 16-core host: one core a socket); off, they come on a "
        "plain socket of their own, each frame MAC'd under its grant's fresh key (authenticated, not secret). "
        "Under --insecure-zmq frames come on the one socket, CRC-checked, and this is refused", roles=DECODE)
    kv_frames_port: Port = setting(0, "decode: TCP port of that plain socket for MAC'd KV frames (0: ephemeral; "
                                   "refused with --encrypt-kv-frames or --insecure-zmq)", roles=DECODE)
    # one connection's bytes move on one libzmq I/O thread, which one stream of frames saturates: more sockets, more
    # threads; a few, not one a core, since each side's pool threads MAC and write the frames besides
    kv_frame_streams: int = setting(
        4, "decode: plain sockets that MAC'd KV frames come on, each its own connection and I/O thread; a prefill "
        "worker deals a transfer's frames across them (with --kv-frames-port P: ports P .. P+N-1; refused with "
        "--encrypt-kv-frames or --insecure-zmq)", ge=1, le=MAX_FRAME_STREAMS, roles=DECODE)
    max_handoffs_per_peer: int | None = setting(
        None, "decode: KV handoffs one prefill worker may have granted and not yet landed here, per model; past it "
        "its asks are refused (it retries), so no one peer can take every seat (default: half of --max-num-seqs)",
        ge=1, roles=DECODE)
    worker_id: str = setting(help="this worker's name in Redis (default: host-pid-random)", default_factory=_worker_id)
    model_path: str = ""  # directory with the tokenizer, published for gateways
    handoff_timeout_s: float = setting(10.0, "seconds a prefill worker waits for a decode worker to take a KV "
                                       "handoff (a full decode batch makes it wait, not fail); on a decode worker, "
                                       "how long a grant's blocks wait for their KV", flag="--handoff-timeout",
                                       gt=0, roles=("prefill", "decode"))
    # a prefill worker's: which decode workers it hands KV to; a job reader's: which peers' unread jobs it takes
    stalled_step_timeout_s: float = common.stalled_step_timeout(roles=JOB_READERS)
    stream_kv_layers: bool = setting(True, "prefill workers ask decode workers for blocks just before a prompt's "
                                     "last chunk and send its KV layer by layer while that chunk computes (off: "
                                     "after the prefill)", flag="--kv-stream-layers", roles=PREFILL)
    max_deliveries: int = setting(keys.MAX_DELIVERIES, "deliveries of a job before it goes to the dead-letter "
                                  "stream", ge=1, roles=JOB_READERS)
    reclaim_idle_ms: int = setting(15_000, "a pending job idle this long belongs to a dead prefill worker and is "
                                   "claimed", ge=1, roles=JOB_READERS)
    # the heartbeat does not wait for steps, so this is the one bound on how long a stuck worker keeps its
    # requests (shared/worker/stall_watch.py)
    step_timeout_s: float = setting(
        120.0,
        "seconds one engine step may run (or the loop wait for its turn while a model load holds it) before the "
        "worker counts as stuck: it takes down the rank groups the step waits on (a rank stopped, wedged in a "
        "collective), or, when nothing can interrupt the step, leaves the registry and exits, for its supervisor "
        "to restart and its peers to run its requests again. Far above the longest legitimate step, a full "
        "--max-num-batched-tokens chunk prefilled on a CPU (tens of seconds for a 1B model; compiles and CUDA "
        "graph captures happen in warm-up, before a model serves); a slow step under it keeps the worker "
        "registered (0: no watch)",
        flag="--step-timeout", shared=True, ge=0)
    # how this worker's kernels share the GPU with the other role's process on it (shared/worker/gpu_share.py)
    gpu_share: Literal["auto", "timeslice", "priority", "mps", "mps-priority", "green"] = setting(
        "auto", "how the prefill and decode processes on one GPU share it: auto (kvrelay serve --mode "
        "disaggregated on one CUDA GPU, one process per role, where nvidia-cuda-mps-control runs: mps-priority "
        "with prefill on 90 percent of the SMs and decode on all of them, the split measured best; else, and for a "
        "worker started on its own, timeslice), timeslice (the driver alternates them), priority (decode computes "
        "on a high-priority CUDA stream, prefill on a low-priority one), mps (CUDA MPS, each process limited to "
        "--gpu-sm-percent of the SMs; kvrelay serve runs the daemon), mps-priority (both: under MPS the two "
        "processes' streams are ordered against each other), green (a CUDA green context of --gpu-sm-percent of "
        "the SMs; torch >= 2.9, CUDA >= 12.8)")
    gpu_sm_percent: int = setting(GPU_SM_PERCENT, "--gpu-share mps, mps-priority or green: percent of the GPU's SMs "
                                  "this worker's kernels may use; refused with the other modes (kvrelay serve: the "
                                  "prefill worker's; the decode worker's is --decode-gpu-sm-percent)", ge=1, le=100)
    monitoring_port: Port | None = setting(None, "Prometheus /metrics port (default: not served; 0: ephemeral)")
    metrics_tenant_labels: bool = common.metrics_tenant_labels()
    drain_timeout_s: float = common.drain_timeout()
    min_residency_s: float = setting(
        MIN_RESIDENCY_S, "seconds a model just loaded keeps its place against a load in no more than twice its "
        "demand, however busy (at least 5 of its reloads: shared/worker/eviction.py); long enough for its demand "
        "to show, so two models of similar demand do not take turns reloading", ge=0)
    more_models: list[StartupModel] = field(default_factory=list)  # loaded at startup besides ``engine``'s
    model_repo: ExistingDir | None = common.model_repo()
    weights_memory: int | None = setting(None, "a worker of several models: bytes its models may take besides "
                                         "their KV at once, per device: their weights (a tensor- or pipeline-parallel "
                                         "model counts its largest shard on CUDA, all of them on the CPU), what each "
                                         "keeps beside them (CUDA graphs, buffers: measured once loaded) and the "
                                         "largest step's activations, once; loads beyond it evict idle models "
                                         "(default: CPU 8 GiB; CUDA what --gpu-memory-utilization leaves after the KV "
                                         "pool, less 1 GiB of allocator slack)", ge=1)
    verify_checksums: bool = setting(True, "hash a repository model's files against its manifest before loading "
                                     "it (once per file version per host: shared/repo/verified_files.py)")
    skip_warmup: bool = setting(False, "serve without first running each step shape once (on CUDA the first requests "
                                "then pay for Triton compiles; SGLang's --skip-server-warmup)")
    share_weights: bool = setting(True, "worker processes on one device that host the same model version map one "
                                  "copy of its weights (shared memory on CPU, CUDA IPC on a GPU) instead of "
                                  "each loading its own (shared/worker/shared_weights.py)", shared=True)
    share_weights_dir: str | None = setting(None, "where shared weights and their registry live (default: "
                                            "/dev/shm/kvrelay-weights-<uid>; under kvrelay serve, a folder of "
                                            "its deployment's own: kvrelay/weight_scope.py); workers that share "
                                            "must agree",
                                            shared=True, env="KVRELAY_SHARE_WEIGHTS_DIR")
    register: list[ModelSpec] = field(default_factory=list)  # registry entries to create if absent
    # name -> (tensor_parallel_size, pipeline_parallel_size) of each model of --config (lazy ones too): every
    # load of it, at startup or later, is its own rank group of that size; other models take ``engine``'s
    parallel_sizes: dict[str, tuple[int, int]] = field(default_factory=dict)
    # name -> whether each model of --config keeps the pipeline batch queue (its own key, else the flag where it
    # has a pipeline), for every load of it as for ``parallel_sizes``; other models take ``engine``'s
    batch_queues: dict[str, bool] = field(default_factory=dict)
    # name -> whether each model of --config calculates its fp8 KV scales (its own key, else the flag where its KV
    # is fp8), for every load of it as for ``parallel_sizes``; other models take ``engine``'s where their KV is fp8
    calculated_kv_scales: dict[str, bool] = field(default_factory=dict)
    # --calculate-kv-scales for the models of no --config entry loaded later (the admin API's) whose KV is fp8, on
    # a worker started without a model of its own: such a model may bring an fp8 KV where the worker's is auto
    later_kv_scales: bool = False
    freeze_gc: bool = False  # a worker process of its own: see shared/worker/gc_freeze.py

    def __post_init__(self) -> None:
        role_settings.check(self)
        if self.gpu_sm_percent != GPU_SM_PERCENT:
            check_sm_share(self.gpu_share, "--gpu-sm-percent")
        depends.check(self, NEEDS)
        if self.kv_frames_port and self.kv_frames_port + self.kv_frame_streams - 1 > 65535:
            raise ConfigError(f"argument --kv-frames-port: {self.kv_frame_streams} sockets (--kv-frame-streams) from "
                              f"port {self.kv_frames_port} run past 65535")

    def startup_models(self) -> list[StartupModel]:
        first = [StartupModel(self.model_name, self.engine, self.model_path)] if self.model_name else []
        return first + self.more_models

    @property
    def multi_model(self) -> bool:
        """Several models, now or later: they share one KV pool and a weights budget."""
        return bool(self.model_repo) or len(self.startup_models()) > 1


def _one_model(config: WorkerConfig) -> str:
    return "" if config.multi_model else ("only on a worker of several models (--config listing two or more, or "
                                          "--model-repo), which share its memory")


def _kv_frames_socket(config: WorkerConfig) -> str:
    if config.insecure_zmq:
        return "not with --insecure-zmq (KV frames come on the one ZMQ socket)"
    return "not with --encrypt-kv-frames (KV frames come on the CURVE socket)" if config.encrypt_kv_frames else ""


# settings that only another setting's value makes take effect (shared/config/depends.py)
NEEDS = (
    depends.Needs(("kv_frames_port",), _kv_frames_socket),
    depends.Needs(("kv_frame_streams",), _kv_frames_socket),
    depends.Needs(("encrypt_kv_frames",), lambda c: "not with --insecure-zmq (no CURVE socket to encrypt them on)"
                  if c.insecure_zmq else ""),
    depends.Needs(("weights_memory",), _one_model),
    depends.Needs(("min_residency_s",), _one_model),  # a worker of one model never evicts it
    depends.Needs(("verify_checksums",), lambda c: "" if c.model_repo else "only with a model repository "
                  "(--model-repo, or a --config's model_repo): only its models have manifests"),
    depends.Needs(("metrics_tenant_labels",), lambda c: "" if c.monitoring_port is not None else
                  "only with --monitoring-port (without it the worker serves no /metrics)"),
    # several models share one KV pool of --kv-cache-memory bytes (shared/worker/host_budget.py)
    depends.Needs(("engine", "cache", "num_gpu_blocks"), lambda c: "only on a worker of one model (several share "
                  "one KV pool of --kv-cache-memory bytes)" if c.multi_model else ""),
)
