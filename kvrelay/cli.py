"""The ``kvrelay`` command. Argument parsing only: each subcommand hands off to the module that owns it."""

import argparse
import logging
import sys

from shared.cli_args import add_engine_args, add_gateway_args, add_worker_args


def _serve(args: argparse.Namespace) -> int:
    from shared.launcher import serve

    return serve(args)


def _gateway(args: argparse.Namespace) -> int:
    from gateway.app import run_gateway
    from gateway.config import GatewayConfig

    run_gateway(GatewayConfig(host=args.host, port=args.port, redis_url=args.redis_url,
                              max_body_size=args.max_body_size, request_timeout=args.request_timeout))
    return 0


def _worker(role: str):
    def run(args: argparse.Namespace) -> int:
        from shared.worker_entry import run_worker

        return run_worker(role, args)

    return run


def _bench(sub: argparse._SubParsersAction) -> None:
    from bench import offline

    bench = sub.add_parser("bench", help="benchmarks (each prints a same-run baseline and the ratio)")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    for name, fn in (("throughput", offline.run_throughput), ("latency", offline.run_latency)):
        p = kinds.add_parser(name, help=f"offline {name}")
        offline.add_args(p)
        p.set_defaults(func=fn)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrelay", description="kvrelay: disaggregated multi-model LLM serving")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="Redis (embedded unless --redis-url), gateway and workers on one machine")
    add_engine_args(serve)
    add_gateway_args(serve)
    serve.set_defaults(redis_url=None)
    serve.add_argument("--mode", choices=["disaggregated", "unified"], default="disaggregated")
    serve.set_defaults(func=_serve)

    gw = sub.add_parser("gateway", help="the OpenAI-compatible HTTP front door")
    add_gateway_args(gw)
    gw.set_defaults(func=_gateway)

    for role in ("prefill", "decode", "unified"):
        p = sub.add_parser(f"{role}-worker", help=f"a {role} worker")
        add_engine_args(p)
        add_worker_args(p)
        p.set_defaults(func=_worker(role))

    _bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = args.func(args)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
