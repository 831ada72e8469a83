"""Settings more than one role has, with the same meaning: declared here once and used by each role's
config, so ``kvrelay serve`` takes each as one flag and hands it to every process that uses it."""

from typing import Any

from kvrelay.shared.config.declare import setting
from kvrelay.shared.config.zmq_secret import SECRET_PATTERN, ZMQ_SECRET_ENV

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
# A URL with a password in argv is readable by every local user (``ps``): the environment is where
# an orchestrator puts it (a Kubernetes Secret as env, compose's env_file), as with the admin key.
REDIS_URL_ENV = "KVRELAY_REDIS_URL"
DRAIN_TIMEOUT_S = 30.0
STALLED_STEP_TIMEOUT_S = 60.0


def redis_url() -> Any:
    return setting(DEFAULT_REDIS_URL, "the Redis server every process shares (queues, registry, heartbeats): "
                   "redis://USER:PASSWORD@HOST:PORT/DB, rediss:// for TLS (?ssl_ca_certs=FILE&ssl_certfile=FILE"
                   "&ssl_keyfile=FILE), unix://, or redis-cluster://USER:PASSWORD@HOST:PORT,HOST:PORT (a Redis "
                   f"Cluster; rediss-cluster:// for TLS); default ${REDIS_URL_ENV}, which keeps the password out of argv",
                   shared=True, env=REDIS_URL_ENV)


def drain_timeout() -> Any:
    return setting(DRAIN_TIMEOUT_S, "seconds SIGTERM lets in-flight requests finish (new ones are refused) "
                   "before the rest are handed back or ended", flag="--drain-timeout", shared=True, ge=0)


def stalled_step_timeout(roles: tuple[str, ...] = ()) -> Any:
    # a worker's heartbeat does not wait for its steps (shared/worker/registration.py): a live record is no proof
    # that its engine loop steps. Under the workers' --step-timeout (120 s), which ends a stuck worker
    return setting(STALLED_STEP_TIMEOUT_S, "seconds a worker's engine loop may be in one step (as its heartbeat "
                   "says) before it counts as stalled (shared/wire/step_stall.py): the gateway routes no new job to "
                   "it (with no other worker for a model, its requests get 503 + Retry-After), prefill workers "
                   "hand it no KV, and prefill and unified workers take the jobs routed to it that it has not read "
                   "(shared/wire/job_adoption.py). Generous: a first step's Triton compile or a long prefill is legit "
                   "(0: never)",
                   shared=True, roles=roles, ge=0)


def model_repo() -> Any:
    return setting(None, "model repository (shared/repo/model_repo.py): the gateway checks admin registrations "
                   "against it, workers load from it and take load/unload commands", shared=True)


def metrics_tenant_labels() -> Any:
    return setting(False, "show tenant names in /metrics' tenant label (default: a 12-hex-digit hash of the name "
                   "under a per-deployment salt, since /metrics needs no key: shared/wire/tenant_label.py)",
                   shared=True)


def zmq_secret_file() -> Any:
    return setting(None, "file holding the deployment's ZMQ secret (64 hex digits, mode 0600; e.g. from 'openssl "
                   "rand -hex 32'), the same for every process: it authenticates every internal socket (CURVE) "
                   f"(default: ${ZMQ_SECRET_ENV}; kvrelay serve generates one)", shared=True)


def insecure_zmq() -> Any:
    return setting(False, "internal ZMQ sockets without authentication: any process that reaches them can forge "
                   "KV handoffs and token events", shared=True)


def zmq_secret() -> Any:
    # no flag (argv is visible to every local user): resolved from the two above (shared/config/zmq_secret.py)
    # or handed over by kvrelay serve; masked in --print-config
    return setting(None, secret=True, pattern=SECRET_PATTERN)

