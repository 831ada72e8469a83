"""Command-line flags shared by every process that runs an engine, named as vLLM names them, and
their translation into config dataclasses."""

import argparse
import os

from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvrelay.shared.repo.model_source import ResolvedModel, dummy_tokenizer_dir, resolve_model


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF model directory, .gguf file, 'smollm2' (default) or dummy:<preset> (e.g. dummy:llama-3-8b)")
    g.add_argument("--served-model-name", default=None, help="the name clients use (default: from --model)")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    g.add_argument("--device", default="auto")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache (CPU default: 1 GiB)")
    g.add_argument("--num-gpu-blocks-override", dest="num_gpu_blocks", type=int, default=None)
    g.add_argument("--swap-space", type=float, default=0.0, help="GiB of host memory for preempted KV")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument("--enforce-eager", action="store_true", help="CUDA: run decode eagerly, without CUDA graphs")
    g.add_argument("--tenant-fairness", action=argparse.BooleanOptionalAction, default=True,
                   help="admit between tenants by tokens served, so one tenant's flood cannot starve another")
    g.add_argument("--tenant-kv-quota", type=float, default=None, metavar="FRACTION",
                   help="max share of KV blocks one tenant may hold; its further requests wait (default: none)")


def engine_config_from_args(args: argparse.Namespace, with_model: bool = True) -> tuple[EngineConfig, str, str]:
    """Returns (engine config, served model name, model directory for tokenizers; '' for dummy).
    ``with_model=False`` gives only the engine settings (no ``--model`` resolved, not even the default):
    for a worker whose models come from ``--config`` or the repository."""
    resolved = resolve_model(args.model, args.load_format) if with_model else ResolvedModel("", "auto", "")
    name = args.served_model_name or resolved.served_name
    config = EngineConfig(
        model=ModelConfig(model=resolved.path, dtype=args.dtype, max_model_len=args.max_model_len,
                          load_format=resolved.load_format, tokenizer=args.tokenizer, seed=args.seed,
                          served_model_name=name, enforce_eager=args.enforce_eager),
        cache=CacheConfig(block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
                          kv_cache_memory=args.kv_cache_memory, num_gpu_blocks=args.num_gpu_blocks,
                          swap_space=args.swap_space, enable_prefix_caching=args.enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  enable_chunked_prefill=args.enable_chunked_prefill, policy=args.scheduling_policy,
                                  tenant_fairness=args.tenant_fairness, tenant_kv_quota=args.tenant_kv_quota),
        device=args.device,
    )
    if not with_model:
        model_dir = ""
    elif args.tokenizer:
        model_dir = args.tokenizer
    elif resolved.load_format == "dummy":
        model_dir = str(dummy_tokenizer_dir(resolved.path.removeprefix("dummy:")))
    else:
        model_dir = resolved.path
    return config, name, model_dir


def add_worker_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("worker")
    g.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    g.add_argument("--host", default="127.0.0.1", help="ZMQ bind address (loopback unless configured)")
    g.add_argument("--advertise-host", default=None,
                   help="the address peers dial to reach this worker (default: --host); set it when --host is "
                        "a wildcard, e.g. to the pod IP or the compose service name")
    g.add_argument("--port", type=int, default=0, help="ZMQ port (0: ephemeral)")
    g.add_argument("--worker-id", default=None)
    g.add_argument("--handoff-timeout", type=float, default=10.0)
    g.add_argument("--kv-stream-layers", action=argparse.BooleanOptionalAction, default=True,
                   help="prefill workers ask decode workers for blocks just before a prompt's last chunk and "
                        "send its KV layer by layer while that chunk computes (off: after the prefill)")
    g.add_argument("--reclaim-idle-ms", type=int, default=15_000)
    g.add_argument("--monitoring-port", type=int, default=None, help="Prometheus metrics port")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM lets running requests finish before the rest are handed back or ended")
    m = p.add_argument_group("several models")
    m.add_argument("--config", default=None, metavar="FILE",
                   help="YAML listing the models this worker loads at startup (kvrelay serve --config's form)")
    m.add_argument("--model-repo", default=None, metavar="DIR",
                   help="model repository: the worker then takes load/unload commands (admin API, lazy load)")
    m.add_argument("--weights-memory", type=int, default=None, metavar="BYTES",
                   help="bytes of model weights this worker may hold at once; loads beyond it evict idle models "
                        "(default: CPU 8 GiB; CUDA what --gpu-memory-utilization leaves after the KV pool)")
    m.add_argument("--verify-checksums", action=argparse.BooleanOptionalAction, default=True,
                   help="hash a repository model's files against its manifest before loading it (once per file "
                        "version per host: shared/repo/verified_files.py)")


ADMIN_KEY_ENV = "KVRELAY_ADMIN_KEY"


def add_gateway_args(p: argparse.ArgumentParser, port_default: int = 8000) -> None:
    g = p.add_argument_group("gateway")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=port_default)
    g.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    # The environment is the better place for it: argv shows in `ps` to every local user.
    g.add_argument("--admin-key", default=os.environ.get(ADMIN_KEY_ENV) or None,
                   help=f"bearer key of the /admin API; also makes the API require tenant keys "
                        f"(default: ${ADMIN_KEY_ENV})")
    g.add_argument("--response-cache-ttl", type=float, default=0.0,
                   help="seconds a deterministic (temperature 0 or seeded) response is reused (0: off)")
    g.add_argument("--reuse-port", action="store_true",
                   help="bind with SO_REUSEPORT, so several gateway processes serve one port")
    g.add_argument("--max-body-size", type=int, default=1024 * 1024)
    g.add_argument("--request-timeout", type=float, default=600.0)
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM lets in-flight requests finish (new ones get 503) before exiting")
    g.add_argument("--max-queue-depth", type=int, default=4096,
                   help="jobs queued per model past which new requests get 429 (0: unbounded)")
    g.add_argument("--zmq-host", default="127.0.0.1", help="where workers' token events arrive (bind address)")
    g.add_argument("--zmq-port", type=int, default=0, help="port for token events (0: ephemeral)")
    g.add_argument("--zmq-advertise-host", default=None,
                   help="the address workers dial for token events; required when --zmq-host is a wildcard")
    m = p.add_argument_group("models")
    m.add_argument("--model-repo", default=None, metavar="DIR",
                   help="model repository the admin API registers models from (workers load from their own)")
    m.add_argument("--model-load-timeout", type=float, default=120.0,
                   help="seconds a request for a registered but unloaded model waits for its load")
    m.add_argument("--reconcile-interval-s", type=float, default=5.0,
                   help="how often one gateway loads missing pinned/min-replica models and ends finished swaps")
