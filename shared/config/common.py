"""Settings more than one role has, with the same meaning: declared here once and used by each role's
config, so ``kvrelay serve`` takes each as one flag and hands it to every process that uses it."""

from typing import Any

from kvrelay.shared.config.declare import setting

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
# A URL with a password in argv is readable by every local user (``ps``): the environment is where
# an orchestrator puts it (a Kubernetes Secret as env, compose's env_file), as with the admin key.
REDIS_URL_ENV = "KVRELAY_REDIS_URL"
DRAIN_TIMEOUT_S = 30.0


def redis_url() -> Any:
    return setting(DEFAULT_REDIS_URL, "the Redis server every process shares (queues, registry, heartbeats): "
                   "redis://USER:PASSWORD@HOST:PORT/DB, rediss:// for TLS (?ssl_ca_certs=FILE&ssl_certfile=FILE"
                   f"&ssl_keyfile=FILE), or unix://; default ${REDIS_URL_ENV}, which keeps the password out of argv",
                   shared=True, env=REDIS_URL_ENV)


def drain_timeout() -> Any:
    return setting(DRAIN_TIMEOUT_S, "seconds SIGTERM lets in-flight requests finish (new ones are refused) "
                   "before the rest are handed back or ended", flag="--drain-timeout", shared=True, ge=0)


def model_repo() -> Any:
    return setting(None, "model repository (shared/repo/model_repo.py): the gateway checks admin registrations "
                   "against it, workers load from it and take load/unload commands", shared=True)
