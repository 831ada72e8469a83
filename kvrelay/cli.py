"""The ``kvrelay`` command. Argument parsing only: each subcommand hands off to the module that owns it.
Every role's flags are generated from its config declaration (shared/config/); a role started by
``kvrelay serve`` gets its config as JSON on stdin instead (shared/config/handover.py)."""

import argparse
import importlib
import importlib.metadata
import logging
import os
import sys

from kvrelay.cli_args import add_gateway_args, add_serve_args, add_worker_args
from kvrelay.shared.config.declare import ConfigError
from kvrelay.shared.config.engine import DTYPE_NAMES
from kvrelay.shared.config.flags import Parser
from kvrelay.shared.config.handover import CONFIG_FROM_STDIN
from kvrelay.shared.wire import redis_acl, startup_report
from kvrelay.startup_checks import StartupError

ROLES = {"gateway": "gateway", "prefill-worker": "prefill", "decode-worker": "decode", "unified-worker": "unified"}


def _serve(args: argparse.Namespace) -> int:
    from kvrelay.serve import serve

    return serve(args)


def _role(args: argparse.Namespace) -> int:
    """Builds the role's config (from flags, or from the parent's JSON), then prints it (--print-config)
    or runs the role."""
    from kvrelay.shared.config import handover

    role = ROLES[args.command]
    if role == "gateway":
        from kvrelay.cli_args import gateway_config_from_args
        from kvrelay.shared.config.gateway import GatewayConfig

        config = handover.receive(GatewayConfig) if args.config_from_stdin else gateway_config_from_args(args)
    else:
        from kvrelay.shared.config.worker import WorkerConfig
        from kvrelay.workers import worker_config

        config = handover.receive(WorkerConfig) if args.config_from_stdin else worker_config(role, args)
    if args.print_config:
        print(handover.printable(config), flush=True)
        return 0
    if role == "gateway":
        from kvrelay.gateway.app import run_gateway

        run_gateway(config)
        return 0
    from kvrelay.workers import run_worker

    return run_worker(config)


def _add_print_config(p: argparse.ArgumentParser) -> None:
    # hidden: for checking what a process resolved (tests, debugging a deployment), not for operators' help
    p.add_argument("--print-config", action="store_true", help=argparse.SUPPRESS)


def _repo(args: argparse.Namespace):
    from kvrelay.shared.repo.model_repo import ModelRepository

    return ModelRepository(args.repo)


def _models_import(args: argparse.Namespace) -> int:
    from kvrelay.shared.repo.model_import import import_model
    from kvrelay.shared.repo.model_repo import RepositoryError

    try:
        if args.quantization:
            mv = _import_quantized(args)
        else:
            mv = import_model(_repo(args), args.source, args.name, args.version, dtype=args.dtype)
    except (RepositoryError, ValueError) as exc:  # a version that exists, a name out of bounds, a model the
        # quantizer does not take: one line, not a traceback
        print(f"kvrelay models import: error: {exc}", file=sys.stderr)
        return 1
    print(f"imported {mv.name} version {mv.version} -> {mv.path}")
    return 0


def _import_quantized(args: argparse.Namespace):
    """The source (an HF directory, or what a .gguf / 'smollm2' imports to) written quantized into a
    scratch folder, then imported from there as any HF directory."""
    import tempfile
    from pathlib import Path

    from kvrelay.shared.engine.quant.checkpoint import quantize_checkpoint
    from kvrelay.shared.repo.model_import import import_model
    from kvrelay.shared.repo.model_source import resolve_model

    repo = _repo(args)
    source = Path(resolve_model(args.source).path)
    with tempfile.TemporaryDirectory(prefix="kvrelay-quantizing-") as scratch:
        quantized = quantize_checkpoint(source, Path(scratch) / "model", args.quantization, args.group_size)
        return import_model(repo, str(quantized), args.name, args.version, dtype=args.dtype,
                            label=f"{args.source} (quantized: {args.quantization})")


def _models_list(args: argparse.Namespace) -> int:
    from kvrelay.shared.repo.model_repo import RepositoryError

    try:
        versions = _repo(args).list()
    except RepositoryError as exc:  # a version with a file linked out of the repository, a manifest of another
        print(f"kvrelay models list: error: {exc}", file=sys.stderr)
        return 1
    print(f"{'NAME':24} {'VERSION':>7} {'DTYPE':9} {'QUANT':18} {'MAX LEN':>8} {'ARCHITECTURE':24} SOURCE")
    for mv in versions:
        print(f"{mv.name:24} {mv.version:>7} {mv.dtype:9} {mv.quantization or '-':18} {mv.max_model_len:>8} "
              f"{mv.architecture:24} {mv.source}")
    return 0


def _models(sub: argparse._SubParsersAction) -> None:
    models = sub.add_parser("models", help="the versioned model repository")
    kinds = models.add_subparsers(dest="models_cmd", required=True)
    default_repo = os.environ.get("KVRELAY_MODEL_REPO", "model_repo")
    imp = kinds.add_parser("import", help="import an HF directory, a .gguf file, or 'smollm2' as a new version")
    imp.add_argument("source")
    imp.add_argument("--name", required=True)
    imp.add_argument("--version", type=int, default=None, help="default: the next number")
    imp.add_argument("--dtype", default="auto", choices=("auto", *DTYPE_NAMES),
                     help="a GGUF file's weights as written (auto: the file's float type; bfloat16 for a quantized "
                     "file); the engine converts to its --dtype at load")
    imp.add_argument("--quantization", choices=("fp8", "int8", "awq", "gptq"), default=None,
                     help="store the model quantized: fp8 / int8 per output channel (compressed-tensors layout), "
                     "awq / gptq 4-bit round-to-nearest groups (AutoAWQ GEMM / GPTQ layout, no calibration); "
                     "the Llama family")
    imp.add_argument("--group-size", type=int, default=128, help="awq / gptq: inputs per scale and zero point")
    imp.add_argument("--repo", default=default_repo)
    imp.set_defaults(func=_models_import)
    lst = kinds.add_parser("list", help="list models and versions")
    lst.add_argument("--repo", default=default_repo)
    lst.set_defaults(func=_models_list)


# kind -> (module, function, help). Each benchmark's module declares its own flags and is imported only
# when it runs: the benchmarks import torch, which `kvrelay gateway` must not load to parse its flags.
# Each help says what the benchmark prints, and what it compares against in the same run.
BENCHES = {
    "throughput": ("kvrelay.bench.offline", "run_throughput", "offline engine: output and total tok/s; with "
                   "--baseline hf also HF generate as one padded batch and one prompt at a time, and the ratios "
                   "(default: no baseline)"),
    "latency": ("kvrelay.bench.offline", "run_latency", "offline engine: median ms per batch and per token; with "
                "--baseline hf also HF generate on the same batch and the speed-up (default: no baseline)"),
    "gpu": ("kvrelay.bench.gpu", "run", "one GPU: decode and prefill against the floors measured in the same run "
            "and HF generate, fused vs unfused kernels, CUDA graphs vs eager"),
    "serve": ("kvrelay.bench.serve", "run", "load generator against an OpenAI-compatible server: vLLM's serving "
              "metrics (TTFT, TPOT, ITL, throughput); --compare-offline adds the offline engine on the same "
              "prompts and the ratio; --sweep finds each server's highest Poisson rate within p99 TTFT and ITL "
              "SLOs (goodput), as a fraction of the offline engine's req/s"),
    "handoff": ("kvrelay.bench.handoff", "run", "KV handoff between two processes: GB/s of frames against raw "
                "ZMQ, and of CUDA IPC against an in-process device copy, with where the time goes"),
    "chat-handoff": ("kvrelay.bench.chat_handoff", "run", "KV handoff bytes of a multi-turn chat load through a "
                     "disaggregated stack, per turn: received bytes and reused prompt blocks with the decode worker's "
                     "reuse on and off (--no-enable-prefix-caching there), in the same call, and the ratio"),
    "rank-handoff": ("kvrelay.bench.rank_handoff", "run", "a tensor-parallel prefill's KV handoff: GB/s with each "
                     "rank sending its own KV heads against rank 0 gathering them first, in the same run"),
    "arbitration": ("kvrelay.bench.kv_arbitration", "run", "two co-resident models: tok/s of one KV pool "
                    "arbitrated by demand and of a static split, and the ratio"),
    "pool": ("kvrelay.bench.pool_density", "run", "N distinct models of one shape under a Zipf mix: how many fit, "
             "per-model TTFT/TPOT, tok/s, cold-load cost and goodput of one shared pool and of a static 1/N split "
             "in the same run, and the ratios"),
    "structured": ("kvrelay.bench.structured", "run", "decode tok/s at batch 64 with and without a 10-field "
                   "json_schema on the same prompts in the same process, and the ratio"),
    "perplexity": ("kvrelay.bench.quant_perplexity", "run", "perplexity of one model on a fixed text under each "
                   "weight quantization (fp8, int8, 4-bit AWQ/GPTQ layouts) beside fp32 and bf16, and the change"),
    "quant": ("kvrelay.bench.quant_speed", "run", "one GPU: batch-1 decode step and prefill of bf16, fp8, int8 and "
              "AWQ int4 weights, each in its own process in one call, each against its weight-read floor"),
    "kv": ("kvrelay.bench.kv_capacity", "run", "one GPU: the largest batch at an 8k context and the decode "
           "tok/s at it, KV in the model's dtype beside --kv-cache-dtype fp8, from the same KV memory in one process"),
    "pp-queue": ("kvrelay.bench.pp_queue", "run", "pipeline parallelism draining every step against the batch "
                 "queue (--pipeline-batch-queue) on the same model and prompts in one call: output tok/s and the ratio"),
    "swap": ("kvrelay.bench.hot_swap", "run", "a version swap under load: swap time, failed requests, and the "
             "other model's latency before, during and after it"),
}


def _bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (KIND --help: what each prints)",
                           description="\n".join(f"{kind}: {help}" for kind, (_, _, help) in BENCHES.items()),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("bench_kind", choices=BENCHES, metavar="KIND", help="one of: " + ", ".join(BENCHES))
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's flags (KIND --help)")
    bench.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    module_name, function, help = BENCHES[args.bench_kind]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"kvrelay bench {args.bench_kind}", description=help)
    module.add_args(parser)
    return getattr(module, function)(parser.parse_args(args.bench_args))


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvrelay", description="kvrelay: disaggregated multi-model LLM serving")
    parser.add_argument("--version", action="version", version=f"%(prog)s {importlib.metadata.version('kvrelay')}")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="Redis (embedded unless --redis-url), gateway and workers on one machine",
                           usage="%(prog)s [flags]", description="Takes every flag of every role it starts, "
                           "listed here by role.")
    add_serve_args(serve)
    _add_print_config(serve)
    serve.set_defaults(func=_serve)

    for command, role in ROLES.items():
        p = sub.add_parser(command, usage="%(prog)s [flags]", help="the OpenAI-compatible HTTP front door"
                           if role == "gateway" else f"a {role} worker")
        if role == "gateway":
            add_gateway_args(p)
        else:
            add_worker_args(p, role)
        _add_print_config(p)
        p.add_argument(CONFIG_FROM_STDIN, action="store_true", help=argparse.SUPPRESS)
        p.set_defaults(func=_role)

    _models(sub)
    _bench(sub)
    acl = sub.add_parser("redis-acl", help="print the aclfile of an external Redis: one least-privilege user per "
                         f"role, passwords from ${redis_acl.PASSWORD_ENV['gateway']} and "
                         f"${redis_acl.PASSWORD_ENV['worker']} (stored hashed)")
    acl.add_argument("--sentinel", metavar="MASTER_NAME", help="a Sentinel deployment's: the aclfile of every data "
                     "server gains the replica's and the sentinels' users (passwords from "
                     f"${redis_acl.HA_PASSWORD_ENV['replica']} and ${redis_acl.HA_PASSWORD_ENV['sentinel']})")
    acl.add_argument("--print", dest="part", choices=SENTINEL_PARTS, default="aclfile",
                     help="with --sentinel: the aclfile (default), the lines every data server's redis.conf needs "
                     "(its replication login), or those every sentinel.conf needs (its login to the data servers; "
                     f"with ${redis_acl.SENTINEL_CLIENT_PASSWORD_ENV} set, the password the sentinels ask of "
                     "clients and of each other: the URL's sentinel_password)")
    acl.add_argument("--cluster", action="store_true",
                     help="for every node of a Redis Cluster: adds the replication user (password from "
                          f"${redis_acl.REPLICA_PASSWORD_ENV}) and says on stderr what each node's redis.conf needs")
    acl.set_defaults(func=_redis_acl)
    return parser


SENTINEL_PARTS = ("aclfile", "redis.conf", "sentinel.conf")


def _password(env: str, user: str) -> str:
    password = os.environ.get(env, "")
    if len(password) < 16:
        what = "the password clients give the sentinels" if user == "" else f"the {user} user's password"
        raise ConfigError(f"${env}: {what}, at least 16 characters")
    return password


def _redis_acl(args: argparse.Namespace) -> int:
    if args.part != "aclfile" and not args.sentinel:
        raise ConfigError(f"--print {args.part}: only with --sentinel MASTER_NAME")
    if args.cluster and args.sentinel:
        raise ConfigError("--cluster and --sentinel: a deployment is one or the other")
    if args.part == "redis.conf":
        lines = redis_acl.replica_conf(_password(redis_acl.HA_PASSWORD_ENV["replica"], "replica"))
        sys.stdout.write("\n".join(lines) + "\n")
        return 0
    if args.part == "sentinel.conf":
        client_password = os.environ.get(redis_acl.SENTINEL_CLIENT_PASSWORD_ENV) or None
        if client_password is not None:
            client_password = _password(redis_acl.SENTINEL_CLIENT_PASSWORD_ENV, "")
        lines = redis_acl.sentinel_conf(args.sentinel, _password(redis_acl.HA_PASSWORD_ENV["sentinel"], "sentinel"),
                                        client_password)
        sys.stdout.write("\n".join(lines) + "\n")
        return 0
    passwords = {role: _password(env, role) for role, env in redis_acl.PASSWORD_ENV.items()}
    if args.sentinel:
        passwords |= {user: _password(env, user) for user, env in redis_acl.HA_PASSWORD_ENV.items()}
        sys.stdout.write(redis_acl.aclfile(passwords, sentinel=True))
    elif args.cluster:
        passwords[redis_acl.REPLICA_USER] = _password(redis_acl.REPLICA_PASSWORD_ENV, redis_acl.REPLICA_USER)
        sys.stdout.write(redis_acl.cluster_aclfile(passwords))
        sys.stderr.write(redis_acl.cluster_instructions())
    else:
        sys.stdout.write(redis_acl.aclfile(passwords))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    bench_args = None
    if "bench" in argv and argv.index("bench") + 1 < len(argv) and argv[argv.index("bench") + 1] in BENCHES:
        # a benchmark's flags go to its own parser verbatim: argparse's remainder drops a `--` that
        # follows KIND, which `bench serve -- --max-num-seqs 8` uses to pass engine flags through
        cut = argv.index("bench") + 2
        argv, bench_args = argv[:cut], argv[cut:]
    args, unknown = parser.parse_known_args(argv)
    if bench_args is not None:
        args.bench_args = bench_args
    if unknown:  # said by the subcommand's parser, so the line names the command
        _subparser(parser, args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
    if getattr(args, "config_from_stdin", False):
        _only_hidden_flags(parser, args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        result = args.func(args)
    except Exception as exc:
        if args.command in ROLES and not startup_report.is_ready() and startup_report.expected_cause(exc):
            # a role that could not start for the operator's reason (a port in use, a setting the model
            # refuses, too little memory): one line, to kvrelay serve when it started us, else on stderr
            startup_report.report_fatal(args.command, exc)
            return 2
        if not isinstance(exc, (ConfigError, StartupError)):
            raise  # a bug, or a failure once serving: the traceback is what finds it
        # one line naming the flag or the file and key, or what serve could not start
        print(f"kvrelay {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return result if isinstance(result, int) else 0


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]


def _only_hidden_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A config handed over on stdin is the whole config: a flag beside it would be ignored, so it is refused."""
    defaults = vars(parser.parse_args([args.command]))
    given = [k for k, v in vars(args).items() if k not in ("config_from_stdin", "print_config", "log_level")
             and defaults.get(k) != v]
    if given:
        _subparser(parser, args.command).error(
            f"{CONFIG_FROM_STDIN} takes the whole config; remove --{given[0].replace('_', '-')}")


if __name__ == "__main__":
    sys.exit(main())
