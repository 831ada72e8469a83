"""Gateway configuration; field names are the CLI flags (``--max-body-size`` is ``max_body_size``)."""

import argparse
from dataclasses import dataclass, field

from kvrelay.shared.wire.redis_keys import STREAM_MAXLEN


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"  # behind nginx by default; 0.0.0.0 to face clients directly
    port: int = 8000
    redis_url: str = "redis://127.0.0.1:6379/0"
    max_body_size: int = 1024 * 1024  # bytes; larger request bodies get 413
    request_timeout: float = 600.0  # seconds from arrival to the last token; also the Job deadline
    # Where workers send TokenBatches. Loopback unless configured; with a wildcard bind, workers on other
    # hosts need zmq_advertise_host, the name under which they can reach this gateway.
    zmq_host: str = "127.0.0.1"
    zmq_port: int = 0  # 0: an ephemeral port
    zmq_advertise_host: str | None = None
    stream_maxlen: int = STREAM_MAXLEN  # XADD MAXLEN ~ for the per-model prefill streams
    registry_cache_s: float = 0.5  # how long a Redis view of models/workers is reused across requests
    # Bearer key of the /admin API (tenants, keys, usage). Setting it also makes /v1 require API keys.
    # repr=False: a logged config must not show it.
    admin_key: str | None = field(default=None, repr=False)
    response_cache_ttl: float = 0.0  # seconds deterministic responses are reused; 0: no response cache
    response_cache_max_bytes: int = 1024 * 1024  # larger responses are not cached
    usage_retention_s: int = 35 * 86400  # how long per-minute usage buckets are kept
    queue_metrics_cache_s: float = 1.0  # /metrics reads the queues from Redis at most this often
    retry_after_s: int = 5  # Retry-After on 503 when no worker can serve the model
    default_tenant: str = "default"  # whose requests these are while no tenant exists (open mode)
    disconnect_poll_s: float = 1.0  # how often a waiting request checks that its client is still there
    drain_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGTERM
    reuse_port: bool = False  # SO_REUSEPORT: several gateway processes share the port (--api-server-count)
    # Jobs queued or being prefilled per model (the stream's length: workers delete what they ACK); past
    # it new requests get 429 + Retry-After instead of joining an ever longer wait. 0: unbounded.
    max_queue_depth: int = 4096
    redis_watch_s: float = 0.5  # how often the gateway checks that Redis is the same server
    redis_outage_s: float = 3.0  # Redis unreachable this long: jobs queued there count as lost
    # Prefix affinity (gateway/routing.py): a prompt goes to the prefill worker that likely caches its
    # first prefix_affinity_tokens, unless that worker has more than affinity_slack requests more than
    # the least-loaded one; then to the shared stream, which the first free worker takes from.
    prefix_affinity: bool = True
    affinity_slack: int = 8
    affinity_prefix_tokens: int = 256
    # The versioned model repository (shared/repo/model_repo.py) the admin API checks registrations against;
    # None: registering models through the API is off. Workers read weights from their own --model-repo.
    model_repo: str | None = None
    model_load_timeout: float = 120.0  # how long a request for an unloaded registered model waits for it
    reconcile_interval_s: float = 5.0  # pinned/min_replicas loads and swap cleanup; 0: off

    def __post_init__(self) -> None:
        if self.max_body_size < 1:
            raise ValueError(f"max_body_size must be positive, got {self.max_body_size}")
        if self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be positive, got {self.request_timeout}")
        if self.drain_timeout < 0 or self.max_queue_depth < 0:
            raise ValueError("drain_timeout and max_queue_depth must not be negative")
        if not 0 <= self.zmq_port < 65536 or not 0 <= self.port < 65536:
            raise ValueError("ports must be in [0, 65535]")
        if self.admin_key is not None and len(self.admin_key) < 16:
            raise ValueError("admin_key must be at least 16 characters")
        if self.model_load_timeout <= 0 or self.reconcile_interval_s < 0:
            raise ValueError("model_load_timeout must be positive, reconcile_interval_s not negative")
        if self.response_cache_ttl < 0 or self.usage_retention_s < 60:
            raise ValueError("response_cache_ttl must not be negative, usage_retention_s at least 60")
        if self.affinity_slack < 0 or self.affinity_prefix_tokens < 1:
            raise ValueError("affinity_slack must not be negative, affinity_prefix_tokens at least 1")

    @property
    def reply_host(self) -> str:
        if self.zmq_advertise_host:
            return self.zmq_advertise_host
        if self.zmq_host in ("0.0.0.0", "*", "::"):
            raise ValueError("zmq_host is a wildcard: set zmq_advertise_host to an address workers can reach")
        return self.zmq_host


def add_routing_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("routing")
    g.add_argument("--prefix-affinity", action=argparse.BooleanOptionalAction, default=True,
                   help="send prompts sharing a prefix to the prefill worker that has it cached")
    g.add_argument("--affinity-slack", type=int, default=GatewayConfig.affinity_slack,
                   help="requests more than the least-loaded prefill worker past which affinity yields")
    g.add_argument("--affinity-prefix-tokens", type=int, default=GatewayConfig.affinity_prefix_tokens,
                   help="leading prompt tokens (whole KV blocks) that decide a prompt's worker")


def routing_kwargs(args: argparse.Namespace) -> dict:
    return {"prefix_affinity": args.prefix_affinity, "affinity_slack": args.affinity_slack,
            "affinity_prefix_tokens": args.affinity_prefix_tokens}
