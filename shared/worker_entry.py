"""Runs one worker process of a given role from parsed command-line flags."""

import argparse

from shared.cli_args import engine_config_from_args
from shared.worker_runtime import WorkerConfig


def run_worker(role: str, args: argparse.Namespace) -> int:
    engine, name, model_dir = engine_config_from_args(args)
    config = WorkerConfig(role=role, engine=engine, redis_url=args.redis_url, model_name=name, host=args.host,
                          port=args.port, advertise_host=args.advertise_host, model_path=model_dir,
                          handoff_timeout_s=args.handoff_timeout,
                          reclaim_idle_ms=args.reclaim_idle_ms, drain_timeout_s=args.drain_timeout,
                          monitoring_port=args.monitoring_port)
    if args.worker_id:
        config.worker_id = args.worker_id
    if role == "prefill":
        from prefill_worker.worker import PrefillWorker as cls
    elif role == "decode":
        from decode_worker.worker import DecodeWorker as cls
    else:
        from prefill_worker.unified import UnifiedWorker as cls
    cls(config).run()
    return 0
