"""``kvrelay serve``'s own settings, and the names its command line gives the flags of the roles it starts."""

from typing import Literal

from pydantic.dataclasses import dataclass

from kvrelay.shared.config.declare import CONFIG, setting


@dataclass(config=CONFIG)
class ModelsConfig:
    """Where a worker's models are listed; ``kvrelay serve --config`` takes the same file."""

    config: str | None = setting(None, "YAML listing the models to load at startup (model_repo + models, see "
                                 "kvrelay/serve_config.py); instead of --model", shared=True)


@dataclass(config=CONFIG)
class ServeConfig:
    mode: Literal["disaggregated", "unified"] = setting(
        "disaggregated", "a prefill and a decode worker handing KV over, or one unified worker (no handoff)")
    api_server_count: int | None = setting(
        None, "gateway processes sharing --port (SO_REUSEPORT); default: on a GPU host one per 4 cores, at most 4 "
        "(one Python process admits a burst of requests one at a time and streams ~10-15k tokens/s), else 1", ge=1)
    # A crashed child is restarted with backoff (kvrelay/supervisor.py); one that keeps crashing is a fault
    # a restart will not cure, and saying so beats restarting it for ever.
    max_crashes: int = setting(5, "exits of one child (gateway or worker) within --crash-window that stop serve "
                               "(exit 1) instead of another restart; 1: the first crash stops everything", ge=1)
    crash_window: float = setting(300.0, "seconds over which --max-crashes counts a child's exits (refused with "
                                  "--max-crashes 1)", gt=0)
    # The embedded Redis holds tenants, API keys, registered models, limits and counters: kept in a folder
    # of the user's (kvrelay/state_dir.py), they survive a restart of Redis and of serve.
    # like SGLang's --disaggregation-decode-tp: a prefill batch wants compute, a decode batch room for KV, so
    # the two roles of one model may split it differently (the handoff regroups KV heads and layers)
    decode_tensor_parallel_size: int | None = setting(
        None, "the decode worker's --tensor-parallel-size (--mode disaggregated); default: --tensor-parallel-size",
        ge=1)
    decode_pipeline_parallel_size: int | None = setting(
        None, "the decode worker's --pipeline-parallel-size (--mode disaggregated); default: "
        "--pipeline-parallel-size", ge=1)
    decode_gpu_sm_percent: int | None = setting(
        None, "the decode worker's --gpu-sm-percent (--mode disaggregated, --gpu-share mps or green); default: 100 "
        "minus --gpu-sm-percent", ge=1, le=100)
    state_dir: str | None = setting(None, "folder (0700) where the embedded Redis keeps its append-only file, "
                                    "its passwords and its socket, so tenants, API keys and registered models "
                                    "survive restarts; one kvrelay serve at a time; refused with --redis-url",
                                    min_length=1)


# A worker's flags that are the gateway's on serve's command line (--host, --port) or that serve counts up,
# one value per worker: the worker's side gets a --worker- prefix there.
WORKER_RENAMES = {"host": "--worker-host", "port": "--worker-port", "advertise_host": "--worker-advertise-host",
                  "monitoring_port": "--worker-monitoring-port"}
