"""What ``kvrelay serve`` starts: each child process's name, role command and complete typed config,
built in this process from serve's flags (every role's flags, kvrelay/cli_args.py) and handed to
the child whole (shared/config/handover.py), so no flag is lost between serve and the process using it."""

import argparse
import dataclasses
import os
import shutil

from kvrelay import mps_daemon
from kvrelay.cli_args import GATEWAY_FLAGS, SERVE_WORKER_FLAGS, gateway_config_from_args, zmq_secret
from kvrelay.serve_config import ServedModel, load_serve_config
from kvrelay.shared.config import role_settings
from kvrelay.shared.config.auto_device import auto_device
from kvrelay.shared.config.declare import ConfigError
from kvrelay.shared.config.flags import GIVEN, given
from kvrelay.shared.config.gateway import GatewayConfig
from kvrelay.shared.config.worker import GPU_SM_PERCENT, SHARES_SMS, WorkerConfig, check_sm_share
from kvrelay.shared.repo.model_source import resolve_model
from kvrelay.shared.worker import gpu_share
from kvrelay.workers import worker_config

# Workers sharing one GPU must split --gpu-memory-utilization: each sizes its KV cache from its own
# share, and the prefill side needs room for one batch of prompts, the decode side for every running
# request's context.
ROLE_MEMORY_SHARE = {"prefill-worker": 0.3, "decode-worker": 0.7, "unified-worker": 1.0}
ROLE_OF = {"prefill-worker": "prefill", "decode-worker": "decode", "unified-worker": "unified"}
# --gpu-share auto where both roles share one GPU under MPS: the split that met both latency SLOs at the
# highest rate (README's "One GPU, two processes"; the runs in BENCHMARKS.md). Prefill on every SM starves decode steps of SMs
# (p99 ITL over 25 ms); on 75% or less its chunks run so long that TTFT misses; decode keeps all of them
# and its high-priority stream runs its steps first.
AUTO_SHARE = {"prefill-worker": 90, "decode-worker": 100}
MAX_DEFAULT_GATEWAYS, CORES_PER_GATEWAY = 4, 4  # --api-server-count's default on a GPU host: default_gateways


@dataclasses.dataclass
class Child:
    name: str  # gateway, gateway-1, prefill-worker[SmolLM2-135M-Instruct], ...
    command: str  # the kvrelay subcommand: gateway | prefill-worker | decode-worker | unified-worker
    config: GatewayConfig | WorkerConfig
    generated: set[str] = dataclasses.field(default_factory=set)  # fields the child generates (its worker id)
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # set in its environment, over serve's

    @property
    def is_gateway(self) -> bool:
        return self.command == "gateway"


def models_to_serve(args: argparse.Namespace) -> list[ServedModel]:
    """From --config, else the one --model; GGUF files are imported here once, before workers race to."""
    if args.config:
        _repo, models = load_serve_config(args.config)
    else:
        models = [ServedModel(name=args.served_model_name or "", path=args.model or "", device=args.device,
                              dtype=args.dtype)]
    for m in models:
        try:
            resolved = resolve_model(m.path or None, args.load_format)
        except ValueError as exc:
            raise ConfigError(f"argument --model: {exc}") from None
        m.path, m.name = resolved.path, m.name or resolved.served_name
    return models


def plan(args: argparse.Namespace, models: list[ServedModel], redis_url: str) -> list[Child]:
    _check_serve_own(args)
    repo = args.model_repo
    if args.config and not repo:
        config_repo, _ = load_serve_config(args.config)
        repo = str(config_repo.root) if config_repo is not None else None
    # one secret per start, in every child's config (stdin): the deployment's processes admit only each other
    secret = zmq_secret(args, generate_if_none=True)
    # --gpu-memory-utilization is a CUDA device's (refused on the CPU): the roles split it only there
    device = auto_device() if args.device == "auto" else args.device
    on_gpu = device != "cpu"
    gateways = args.api_server_count or default_gateways(on_gpu)
    gateway = gateway_config_from_args(args, redis_url=redis_url, model_repo=repo, zmq_secret=secret,
                                       reuse_port=args.reuse_port or gateways > 1,
                                       startup_models=[m.name for m in models if not m.lazy],
                                       lazy_models=[m.name for m in models if m.lazy])
    # like vLLM's --api-server-count: one gateway process streams ~10k tokens/s at most, so several share
    # the port and the kernel spreads connections over them; everything they share (limits, usage,
    # registry) lives in Redis, and each has its own token-event socket
    children = [Child("gateway" if i == 0 else f"gateway-{i}", "gateway",
                      dataclasses.replace(gateway, zmq_port=gateway.zmq_port + i if gateway.zmq_port else 0))
                for i in range(gateways)]
    commands = ["unified-worker"] if args.mode == "unified" else ["prefill-worker", "decode-worker"]
    _check_read(args, [ROLE_OF[c] for c in commands])
    decode_sizes = _decode_sizes(args)
    decode_share = _decode_sm_percent(args)
    shared_gpu = args.gpu_share == "auto" and _auto_mps(args, device, models, decode_sizes)
    for i, command in enumerate(commands):
        # one worker per role hosts every model: they share its KV pool (arbitrated by demand) and its
        # weights budget, and models load, unload and swap without restarting anything
        name = command if (args.config or repo) else f"{command}[{models[0].name}]"
        given = vars(args) | {
            "redis_url": redis_url,
            "worker_port": args.worker_port + i if args.worker_port else 0,
            "worker_monitoring_port": None if args.worker_monitoring_port is None else args.worker_monitoring_port + i,
            "worker_id": f"{args.worker_id}-{name}" if args.worker_id else None}
        given |= _unread_defaults(ROLE_OF[command])
        if on_gpu:
            given["gpu_memory_utilization"] = round(args.gpu_memory_utilization * ROLE_MEMORY_SHARE[command], 4)
        if command == "decode-worker":
            given |= decode_sizes | decode_share
        if args.gpu_share == "auto":  # each worker's config says what it runs
            given |= ({"gpu_share": "mps-priority", "gpu_sm_percent": AUTO_SHARE[command]} if shared_gpu
                      else {"gpu_share": "timeslice"})
        given |= _not_applied(args, given, decode_sizes, models)
        if not args.config:
            given |= {"model": models[0].path, "served_model_name": models[0].name}
        # the other role's pipeline size: a models file's key for the pipeline a model has in that role alone
        other = {"prefill-worker": decode_sizes.get("pipeline_parallel_size", args.pipeline_parallel_size),
                 "decode-worker": args.pipeline_parallel_size}.get(command, 1)
        config = worker_config(ROLE_OF[command], argparse.Namespace(**given), SERVE_WORKER_FLAGS, zmq_secret=secret,
                               other_pipeline=other)
        gpu_share.check(config)
        children.append(Child(name, command, config, set() if args.worker_id else {"worker_id"},
                              gpu_share.child_env(config)))
    return children


def default_gateways(on_gpu: bool) -> int:
    """--api-server-count when not given. A GPU's workers take a few of the host's cores and leave the rest
    idle, while one gateway admits a burst of requests one at a time and streams every token of its share
    (BENCHMARKS.md: through one, a GPU's token stream reaches clients in clumps): a gateway per CORES_PER_GATEWAY
    cores, at most
    MAX_DEFAULT_GATEWAYS. CPU workers need every core for their own math: one gateway there."""
    if not on_gpu:
        return 1
    return max(1, min(MAX_DEFAULT_GATEWAYS, (os.cpu_count() or 1) // CORES_PER_GATEWAY))


def _auto_mps(args: argparse.Namespace, device: str, models: list[ServedModel], decode_sizes: dict[str, int]) -> bool:
    """Whether --gpu-share auto puts the two roles under MPS: disaggregated, every model on one CUDA device, one
    process per role (a rank group's processes are not what the measured split is for), and the MPS control
    program here. Anything else, timeslice: the mode that runs everywhere. ``device``: --device, resolved."""
    if args.mode != "disaggregated" or shutil.which(mps_daemon.CONTROL) is None:
        return False
    # each model of --config on the device its entry names, else on --device's
    devices = {m.device if m.device != "auto" else device for m in models} if args.config else {device}
    sizes = [args.tensor_parallel_size, args.pipeline_parallel_size, *decode_sizes.values(),
             *(m.tensor_parallel_size for m in models), *(m.pipeline_parallel_size for m in models)]
    return len(devices) == 1 and next(iter(devices)).startswith("cuda") and max(sizes) <= 1


def timesliced(children: list[Child]) -> None:
    """--gpu-share auto where the MPS daemon would not start (no permission for its folders, a GPU that refuses
    MPS): every worker falls back to timeslice, the mode auto takes where MPS is not on offer."""
    for child in children:
        if not child.is_gateway and child.config.gpu_share in gpu_share.MPS_MODES:
            child.config = dataclasses.replace(child.config, gpu_share="timeslice", gpu_sm_percent=GPU_SM_PERCENT)
            child.env = {k: v for k, v in child.env.items() if k != gpu_share.MPS_SHARE_ENV}


def _check_serve_own(args: argparse.Namespace) -> None:
    """serve's own settings that another of them leaves without effect, given: one line naming both."""
    if args.redis_url and "state_dir" in given(args):
        raise ConfigError("argument --state-dir: only with the embedded Redis (--redis-url, or $KVRELAY_REDIS_URL, "
                          "names another, which keeps its own data)")
    if args.max_crashes == 1 and "crash_window" in given(args):
        raise ConfigError("argument --crash-window: only with --max-crashes 2 or more (1: the first crash stops "
                          "everything, whenever it comes)")


def _check_read(args: argparse.Namespace, roles: list[str]) -> None:
    """A worker setting that no process serve starts reads is an error where the command line gives it."""
    gateway = {f.dest for f in GATEWAY_FLAGS}
    for flag in SERVE_WORKER_FLAGS:
        read = flag.dest in gateway or any(role_settings.reads(flag.info, role) for role in roles)
        if not read and flag.dest in given(args):
            raise ConfigError(f"argument {flag.option}: {role_settings.who_reads(role_settings.roles_of(flag.info))} "
                              f"(--mode {args.mode} starts none)")


def _not_applied(args: argparse.Namespace, worker: dict, decode_sizes: dict[str, int],
                 models: list[ServedModel]) -> dict:
    """A setting serve takes for several processes, which one worker would not apply (shared/config/depends.py):
    that worker's config holds the default, and its flag counts as not given there. --pipeline-batch-queue is
    for the role with a pipeline (--decode-pipeline-parallel-size; a --config model's own pipeline_parallel_size
    gives both roles one, and each worker takes the flag for the models that pipeline); with none in either it
    stays, for the worker to refuse. --metrics-tenant-labels is the gateway's too: workers apply it where they
    serve /metrics."""
    defaults = {}
    own = any(m.pipeline_parallel_size > 1 for m in models)
    pipelines = own or max(args.pipeline_parallel_size, decode_sizes.get("pipeline_parallel_size", 1)) > 1
    if worker["pipeline_parallel_size"] == 1 and not own and pipelines:
        defaults["pipeline_batch_queue"] = False
    if worker["worker_monitoring_port"] is None:
        defaults["metrics_tenant_labels"] = False
    return defaults | ({GIVEN: given(args) - set(defaults)} if defaults else {})


def _unread_defaults(role: str) -> dict:
    """The settings ``role`` does not read, at their defaults: its config holds no value it would ignore."""
    return {f.dest: f.default for f in SERVE_WORKER_FLAGS if not role_settings.reads(f.info, role)}


def _decode_sm_percent(args: argparse.Namespace) -> dict[str, int]:
    """The decode worker's share of the SMs, where --gpu-share gives one: --decode-gpu-sm-percent, else what
    the prefill worker leaves. A share given with a mode that applies none is refused."""
    if args.decode_gpu_sm_percent is not None and args.mode != "disaggregated":
        raise ConfigError("argument --decode-gpu-sm-percent: only with --mode disaggregated (a unified worker has "
                          "one share, --gpu-sm-percent)")
    for dest in ("gpu_sm_percent", "decode_gpu_sm_percent"):
        if dest in given(args):
            check_sm_share(args.gpu_share, "--" + dest.replace("_", "-"))
    if args.gpu_share not in SHARES_SMS:
        return {}
    if args.decode_gpu_sm_percent is not None:
        return {"gpu_sm_percent": args.decode_gpu_sm_percent}
    return {"gpu_sm_percent": 100 - args.gpu_sm_percent if args.gpu_sm_percent < 100 else 100}


def _decode_sizes(args: argparse.Namespace) -> dict[str, int]:
    """The decode worker's own parallel sizes, where --decode-*-parallel-size gives them."""
    sizes = {f"{kind}_parallel_size": getattr(args, f"decode_{kind}_parallel_size") for kind in ("tensor", "pipeline")}
    sizes = {k: v for k, v in sizes.items() if v is not None}
    if sizes and args.mode != "disaggregated":
        flag = "--decode-" + next(iter(sizes)).replace("_", "-")
        raise ConfigError(f"argument {flag}: only with --mode disaggregated (a unified worker has one size)")
    return sizes
