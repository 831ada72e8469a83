"""``kvrelay serve``: everything on one machine. An embedded Redis (unless --redis-url), then the
gateway and the workers as separate processes on loopback, supervised: if one dies the rest are
stopped; Ctrl-C or SIGTERM stops all of them and leaves no orphan (children also get SIGTERM from the
kernel if this process is killed outright)."""

import argparse
import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from kvrelay.shared.config.cli_args import ADMIN_KEY_ENV
from kvrelay.shared.config.serve_config import ServedModel, load_serve_config
from kvrelay.shared.repo.model_source import resolve_model
from kvrelay.shared.wire.protocol import instance_key
from kvrelay.shared.wire.redis_conn import EmbeddedRedis

log = logging.getLogger(__name__)

ENGINE_FLAGS = ["tokenizer", "max_model_len", "load_format", "seed",
                "block_size", "kv_cache_memory", "num_gpu_blocks", "swap_space",
                "max_num_seqs", "max_num_batched_tokens", "scheduling_policy", "tenant_kv_quota"]
STOP_GRACE_S = 10.0


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: a kill -9 of serve still stops the children


def _flag(name: str) -> str:
    return "--" + {"num_gpu_blocks": "num_gpu_blocks_override"}.get(name, name).replace("_", "-")


def engine_argv(args: argparse.Namespace, model_path: str | None) -> list[str]:
    argv = ["--model", model_path] if model_path else []
    for name in ENGINE_FLAGS:
        value = getattr(args, name)
        if value is not None:
            argv += [_flag(name), str(value)]
    for name in ("enable_prefix_caching", "enable_chunked_prefill", "tenant_fairness"):
        argv.append(_flag(name) if getattr(args, name) else _flag(name).replace("--", "--no-", 1))
    return argv


def serve(args: argparse.Namespace) -> int:
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    models = _models_to_serve(args)
    with contextlib.ExitStack() as stack:
        redis_url = args.redis_url or stack.enter_context(EmbeddedRedis())
        cmd = [sys.executable, "-m", "kvrelay.cli", "--log-level", args.log_level]
        roles = ["unified-worker"] if args.mode == "unified" else ["prefill-worker", "decode-worker"]
        specs = [("gateway", cmd + ["gateway", "--host", args.host, "--port", str(args.port), "--redis-url",
                                    redis_url, "--max-body-size", str(args.max_body_size),
                                    "--request-timeout", str(args.request_timeout),
                                    "--response-cache-ttl", str(args.response_cache_ttl),
                                    "--drain-timeout", str(args.drain_timeout),
                                    "--max-queue-depth", str(args.max_queue_depth)])]
        repo = args.model_repo or (_config_repo(args.config) if args.config else None)
        repo_argv = ["--model-repo", str(repo)] if repo else []
        specs[0][1].extend(repo_argv + ["--model-load-timeout", str(args.model_load_timeout)])
        if args.config or repo:
            # one worker per role hosts every model: they share its KV pool (arbitrated by demand) and
            # its weights budget, and models load, unload and swap without restarting anything
            models_argv = ["--config", str(args.config)] if args.config else ["--model", models[0].path,
                                                                               "--served-model-name", models[0].name]
            engine = engine_argv(args, None) + models_argv + ["--dtype", args.dtype, "--device", args.device,
                                                              "--redis-url", redis_url] + repo_argv
            engine.append("--verify-checksums" if args.verify_checksums else "--no-verify-checksums")
            if args.weights_memory:
                engine += ["--weights-memory", str(args.weights_memory)]
            specs += [(role, cmd + [role] + engine + _memory_share(args, role, 1)
                       + ["--drain-timeout", str(args.drain_timeout)]) for role in roles]
        else:
            for m in models:
                engine = engine_argv(args, m.path) + ["--served-model-name", m.name, "--dtype", m.dtype,
                                                      "--device", m.device, "--redis-url", redis_url]
                specs += [(f"{role}[{m.name}]", cmd + [role] + engine + _memory_share(args, role, len(models))
                           + ["--drain-timeout", str(args.drain_timeout)]) for role in roles]
        if not getattr(args, "kv_stream_layers", True):
            for name, argv in specs:
                if name.startswith("prefill-worker"):
                    argv.append("--no-kv-stream-layers")
        if args.worker_monitoring_port is not None:  # workers' /metrics on consecutive ports
            for i, (_, argv) in enumerate(specs[1:]):
                argv += ["--monitoring-port", str(args.worker_monitoring_port + i)]
        if args.api_server_count > 1:
            # like vLLM's --api-server-count: one gateway process streams ~10k tokens/s at most, so
            # several share the port and the kernel spreads connections over them; everything they share
            # (limits, usage, registry) already lives in Redis, and each has its own token-event socket
            gateway_argv = specs[0][1] + ["--reuse-port"]
            specs[0] = ("gateway", gateway_argv)
            specs[1:1] = [(f"gateway-{i}", list(gateway_argv)) for i in range(1, args.api_server_count)]
        threads = _cpu_threads_per_worker(args, sum(not _is_gateway(n) for n, _ in specs))
        procs = {name: subprocess.Popen(argv, preexec_fn=_die_with_parent,
                                        env=_env(name, args.admin_key, threads)) for name, argv in specs}
        names = [m.name for m in models if not m.lazy]
        log.info("serving %s on http://%s:%d (redis %s, %s mode)", names, args.host, args.port, redis_url, args.mode)
        instances = [instance_key(m.name, m.version) for m in models if not m.lazy]
        code = _supervise(procs, lambda: stopping, f"http://{args.host}:{args.port}", names,
                          lambda: _workers_hold(redis_url, instances))
        _stop_all(procs, args.drain_timeout + STOP_GRACE_S)
        return code


# Workers sharing one GPU must split --gpu-memory-utilization: each sizes its KV cache from its own
# share, and the prefill side needs room for one batch of prompts, the decode side for every running
# request's context.
ROLE_MEMORY_SHARE = {"prefill-worker": 0.3, "decode-worker": 0.7, "unified-worker": 1.0}


def _memory_share(args: argparse.Namespace, role: str, num_models: int) -> list[str]:
    share = args.gpu_memory_utilization * ROLE_MEMORY_SHARE[role] / num_models
    return ["--gpu-memory-utilization", f"{share:.4f}"]


def _models_to_serve(args: argparse.Namespace) -> list[ServedModel]:
    """From --config, else the one --model; GGUF files are imported here once, before workers race to."""
    if args.config:
        _repo, models = load_serve_config(args.config)
    else:
        models = [ServedModel(name=args.served_model_name or "", path=args.model or "", device=args.device,
                              dtype=args.dtype)]
    for m in models:
        resolved = resolve_model(m.path or None, args.load_format)
        m.path, m.name = resolved.path, m.name or resolved.served_name
    return models


def _is_gateway(name: str) -> bool:
    return name == "gateway" or name.startswith("gateway-")


def _config_repo(config: str) -> str | None:
    repo, _ = load_serve_config(config)
    return str(repo.root) if repo is not None else None


def _cpu_threads_per_worker(args: argparse.Namespace, num_workers: int) -> int | None:
    """CPU workers split the cores: each one's math library otherwise starts a thread per core, and
    several processes spinning on the same cores slow a step down by an order of magnitude."""
    import torch

    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    if not on_cpu or num_workers <= 1 or "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, (os.cpu_count() or 1) // num_workers)


def _env(name: str, admin_key: str | None, threads: int | None) -> dict[str, str]:
    """The admin key reaches the gateway through its environment (argv shows in `ps`), and no other
    process: workers have no use for it."""
    env = {k: v for k, v in os.environ.items() if k != ADMIN_KEY_ENV}
    if _is_gateway(name) and admin_key:
        env[ADMIN_KEY_ENV] = admin_key
    if threads is not None and not _is_gateway(name):
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _supervise(procs: dict[str, subprocess.Popen], stopping, base_url: str, models: list[str],
               workers_ready=lambda: True) -> int:
    announced = False
    while not stopping():
        for name, proc in procs.items():
            if proc.poll() is not None:
                log.error("%s exited with code %s; stopping everything", name, proc.returncode)
                return proc.returncode or 1
        if not announced and workers_ready() and _ready(base_url, models):
            announced = True
            print(f"kvrelay ready: {base_url}/v1 serving {', '.join(models)}", flush=True)
        time.sleep(0.5)
    return 0


def _workers_hold(redis_url: str, instances: list[str]) -> bool:
    """Every model we started is held by a live prefill-capable and a live decode-capable worker. The
    gateway's /ready does not say so by itself for registered models, which it may load on demand."""
    from kvrelay.shared.wire.redis_conn import sync_client
    from kvrelay.shared.worker.directory import live_workers

    r = sync_client(redis_url)
    try:
        workers = live_workers(r)
    except Exception:  # Redis still starting: not ready yet
        return False
    finally:
        r.close()
    return all(any(i in w.models and w.can_prefill for w in workers)
               and any(i in w.models and w.can_decode for w in workers) for i in instances)


def _ready(base_url: str, models: list[str]) -> bool:
    """Every model is registered and the gateway sees live workers for both of its phases."""
    try:
        try:
            with urllib.request.urlopen(f"{base_url}/v1/models", timeout=1) as resp:
                if not set(models) <= {m["id"] for m in json.load(resp)["data"]}:
                    return False
        except urllib.error.HTTPError as exc:
            if exc.code != 401:  # with an admin key the list wants a tenant key: /ready alone decides
                return False
        with urllib.request.urlopen(f"{base_url}/ready", timeout=1) as resp:
            return resp.status == 200
    except (OSError, ValueError, KeyError):
        return False


def _stop_all(procs: dict[str, subprocess.Popen], grace: float = STOP_GRACE_S) -> None:
    """SIGTERM drains every process (in-flight requests finish, up to --drain-timeout), so they get that
    long plus STOP_GRACE_S. Ctrl-C in a terminal reaches the children too: with this SIGTERM, their
    second signal, they stop at once instead."""
    # workers first so they unregister while Redis is still up; the gateway last
    order = sorted(procs, key=_is_gateway)
    for name in order:
        if procs[name].poll() is None:
            procs[name].send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for name in order:
        try:
            procs[name].wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0fs; killing it", name, grace)
            procs[name].kill()
            procs[name].wait()
