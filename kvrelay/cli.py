"""The ``kvrelay`` command. Argument parsing only: each subcommand hands off to the module that owns it."""

import argparse
import logging
import os
import sys

from kvrelay.gateway.config import add_routing_args
from kvrelay.shared.config.cli_args import add_engine_args, add_gateway_args, add_worker_args


def _serve(args: argparse.Namespace) -> int:
    from kvrelay.serve import serve

    return serve(args)


def _gateway(args: argparse.Namespace) -> int:
    from kvrelay.gateway.app import run_gateway
    from kvrelay.gateway.config import GatewayConfig, routing_kwargs

    run_gateway(GatewayConfig(**routing_kwargs(args), host=args.host, port=args.port, redis_url=args.redis_url,
                              max_body_size=args.max_body_size, request_timeout=args.request_timeout,
                              drain_timeout=args.drain_timeout, max_queue_depth=args.max_queue_depth,
                              zmq_host=args.zmq_host, zmq_port=args.zmq_port,
                              zmq_advertise_host=args.zmq_advertise_host,
                              admin_key=args.admin_key, response_cache_ttl=args.response_cache_ttl,
                              model_repo=args.model_repo, model_load_timeout=args.model_load_timeout,
                              reconcile_interval_s=args.reconcile_interval_s, reuse_port=args.reuse_port))
    return 0


def _worker(role: str):
    def run(args: argparse.Namespace) -> int:
        from kvrelay.shared.worker.entry import run_worker

        return run_worker(role, args)

    return run


def _repo(args: argparse.Namespace):
    from kvrelay.shared.repo.model_repo import ModelRepository

    return ModelRepository(args.repo)


def _models_import(args: argparse.Namespace) -> int:
    mv = _repo(args).import_model(args.source, args.name, args.version, dtype=args.dtype)
    print(f"imported {mv.name} version {mv.version} -> {mv.path}")
    return 0


def _models_list(args: argparse.Namespace) -> int:
    print(f"{'NAME':24} {'VERSION':>7} {'DTYPE':9} {'MAX LEN':>8} {'ARCHITECTURE':24} SOURCE")
    for mv in _repo(args).list():
        print(f"{mv.name:24} {mv.version:>7} {mv.dtype:9} {mv.max_model_len:>8} {mv.architecture:24} {mv.source}")
    return 0


def _models(sub: argparse._SubParsersAction) -> None:
    models = sub.add_parser("models", help="the versioned model repository")
    kinds = models.add_subparsers(dest="models_cmd", required=True)
    default_repo = os.environ.get("KVRELAY_MODEL_REPO", "model_repo")
    imp = kinds.add_parser("import", help="import an HF directory, a .gguf file, or 'smollm2' as a new version")
    imp.add_argument("source")
    imp.add_argument("--name", required=True)
    imp.add_argument("--version", type=int, default=None, help="default: the next number")
    imp.add_argument("--dtype", default="float32", help="for GGUF conversion")
    imp.add_argument("--repo", default=default_repo)
    imp.set_defaults(func=_models_import)
    lst = kinds.add_parser("list", help="list models and versions")
    lst.add_argument("--repo", default=default_repo)
    lst.set_defaults(func=_models_list)


def _bench(sub: argparse._SubParsersAction) -> None:
    from kvrelay.bench import offline

    bench = sub.add_parser("bench", help="benchmarks (each prints a same-run baseline and the ratio)")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    for name, fn in (("throughput", offline.run_throughput), ("latency", offline.run_latency)):
        p = kinds.add_parser(name, help=f"offline {name}")
        offline.add_args(p)
        p.set_defaults(func=fn)
    from kvrelay.bench import gpu as gpu_bench

    p = kinds.add_parser("gpu", help="one GPU: decode/prefill against measured floors and HF, fused vs unfused, graphs vs eager")
    gpu_bench.add_args(p)
    p.set_defaults(func=gpu_bench.run)
    from kvrelay.bench import serve as serve_bench

    p = kinds.add_parser("serve", help="load generator against an OpenAI-compatible server (vLLM's serving benchmark)")
    serve_bench.add_args(p)
    p.set_defaults(func=serve_bench.run)
    from kvrelay.bench import handoff as handoff_bench

    p = kinds.add_parser("handoff", help="KV handoff bandwidth between two processes: frames, CUDA IPC")
    handoff_bench.add_args(p)
    p.set_defaults(func=handoff_bench.run)
    from kvrelay.bench import kv_arbitration

    p = kinds.add_parser("arbitration", help="two co-resident models: one KV pool arbitrated by demand vs a static split")
    kv_arbitration.add_args(p)
    p.set_defaults(func=kv_arbitration.run)
    from kvrelay.bench import hot_swap

    p = kinds.add_parser("swap", help="hot-swap a model version under load: swap time, failures, co-residents' p99")
    hot_swap.add_args(p)
    p.set_defaults(func=hot_swap.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrelay", description="kvrelay: disaggregated multi-model LLM serving")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="Redis (embedded unless --redis-url), gateway and workers on one machine")
    add_engine_args(serve)
    add_gateway_args(serve)
    serve.set_defaults(redis_url=None)
    serve.add_argument("--mode", choices=["disaggregated", "unified"], default="disaggregated")
    serve.add_argument("--config", default=None, help="YAML: model_repo + models to serve (overrides --model)")
    serve.add_argument("--verify-checksums", action=argparse.BooleanOptionalAction, default=True,
                       help="workers hash a repository model's files against its manifest before loading it")
    serve.add_argument("--api-server-count", type=int, default=1, metavar="N",
                       help="gateway processes sharing --port (SO_REUSEPORT): one Python process tops out near "
                            "10k streamed tokens/s")
    serve.add_argument("--worker-monitoring-port", type=int, default=None, metavar="PORT",
                       help="serve each worker's Prometheus /metrics on PORT, PORT+1, ... (gateway: /metrics)")
    serve.add_argument("--weights-memory", type=int, default=None, metavar="BYTES",
                       help="bytes of model weights each worker may hold at once (see the worker flag)")
    serve.add_argument("--kv-stream-layers", action=argparse.BooleanOptionalAction, default=True,
                       help="the prefill worker sends a prompt's KV layer by layer during its last chunk "
                            "(see the worker flag)")
    serve.set_defaults(func=_serve)

    gw = sub.add_parser("gateway", help="the OpenAI-compatible HTTP front door")
    add_gateway_args(gw)
    add_routing_args(gw)
    gw.set_defaults(func=_gateway)

    for role in ("prefill", "decode", "unified"):
        p = sub.add_parser(f"{role}-worker", help=f"a {role} worker")
        add_engine_args(p)
        add_worker_args(p)
        p.set_defaults(func=_worker(role))

    _models(sub)
    _bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = args.func(args)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
