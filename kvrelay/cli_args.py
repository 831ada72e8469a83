"""The command lines of the roles: which declared settings each role's flags come from, and the configs
built back from the parsed flags. The flags themselves are generated from the declarations
(``shared/config/flags.py``); resolving ``--model`` against the model repository is why this lives in the
CLI, above the config layer."""

import argparse
import os

from kvrelay.shared.config import depends
from kvrelay.shared.config import zmq_secret as zmq_secrets
from kvrelay.shared.config.common import REDIS_URL_ENV
from kvrelay.shared.config.declare import ConfigError
from kvrelay.shared.config.engine import EngineConfig
from kvrelay.shared.config.flags import Flag, add_flags, build, flags_of, given, read
from kvrelay.shared.config.gateway import NEEDS as GATEWAY_NEEDS
from kvrelay.shared.config.gateway import GatewayConfig
from kvrelay.shared.config.serve import WORKER_RENAMES, ModelsConfig, ServeConfig
from kvrelay.shared.config.worker import WorkerConfig
from kvrelay.shared.repo.model_source import ResolvedModel, dummy_tokenizer_dir, resolve_model

ENGINE_FLAGS = flags_of(EngineConfig)
WORKER_FLAGS = flags_of(WorkerConfig) + flags_of(ModelsConfig)
GATEWAY_FLAGS = flags_of(GatewayConfig)
SERVE_WORKER_FLAGS = flags_of(WorkerConfig, rename=WORKER_RENAMES)
SERVE_FLAGS = flags_of(ServeConfig) + flags_of(ModelsConfig) + GATEWAY_FLAGS + SERVE_WORKER_FLAGS

TITLES = {"model": "model (each model a worker hosts)", "cache": "KV cache", "scheduler": "scheduler",
          "engine": "engine", "worker": "worker", "models": "several models", "gateway": "gateway",
          "serve": "serve"}
SERVE_TITLES = {**TITLES, "worker": "worker (each worker process; --worker-port and --worker-monitoring-port "
                                    "count up from the first worker, --worker-id gets the worker's name appended)",
                "gateway": "gateway (--zmq-port counts up from the first of --api-server-count gateways)"}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, ENGINE_FLAGS, TITLES)


def add_worker_args(p: argparse.ArgumentParser, role: str) -> None:
    add_flags(p, WORKER_FLAGS, TITLES, role=role)


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, GATEWAY_FLAGS, TITLES)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, SERVE_FLAGS, SERVE_TITLES, defaults={"redis_url": os.environ.get(REDIS_URL_ENV) or None},
              notes={"redis_url": f"default: ${REDIS_URL_ENV}, else an embedded one, started by kvrelay serve",
                     "state_dir": "default: $XDG_DATA_HOME/kvrelay, else ~/.local/share/kvrelay"})


def gateway_config_from_args(args: argparse.Namespace, **derived) -> GatewayConfig:
    if "zmq_secret" not in derived:
        derived["zmq_secret"] = zmq_secret(args)
    config = build(GatewayConfig, {**read(GATEWAY_FLAGS, args), **derived}, GATEWAY_FLAGS)
    depends.check_given(config, GATEWAY_NEEDS, given(args))
    return config


def zmq_secret(args: argparse.Namespace, generate_if_none: bool = False) -> str | None:
    """The deployment's ZMQ secret from --zmq-secret-file or the environment (shared/config/zmq_secret.py)."""
    return zmq_secrets.resolve(args.zmq_secret_file, args.insecure_zmq, generate_if_none)


def engine_config_from_args(args: argparse.Namespace, with_model: bool = True) -> tuple[EngineConfig, str, str]:
    """Returns (engine config, served model name, model directory for tokenizers; '' for dummy).
    ``with_model=False`` gives only the engine settings (no ``--model`` resolved, not even the default):
    for a worker whose models come from ``--config`` or the repository."""
    values = read(ENGINE_FLAGS, args)
    model = values["model"]
    try:
        resolved = resolve_model(model["model"], model["load_format"]) if with_model else ResolvedModel("", "auto", "")
    except ValueError as exc:
        raise ConfigError(f"argument --model: {exc}") from None
    name = model["served_model_name"] or resolved.served_name
    model.update(model=resolved.path, load_format=resolved.load_format, served_model_name=name)
    config = build(EngineConfig, values, ENGINE_FLAGS)
    if not with_model:
        model_dir = ""
    elif model["tokenizer"]:
        model_dir = model["tokenizer"]
    elif resolved.load_format == "dummy":
        model_dir = str(dummy_tokenizer_dir(resolved.path.removeprefix("dummy:")))
    else:
        model_dir = resolved.path
    return config, name, model_dir


def worker_values(args: argparse.Namespace, flags: list[Flag]) -> dict:
    """A worker's own settings from the flags; the engine's come from ``engine_config_from_args``."""
    values = read(flags, args)
    values.pop("engine")
    values.pop("config", None)
    return values
