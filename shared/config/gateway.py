"""Gateway configuration; field names are the CLI flags (``--max-body-size`` is ``max_body_size``).
Imports no torch: the gateway never does."""

from dataclasses import field
from typing import Literal

from pydantic.dataclasses import dataclass

from kvrelay.shared.config import common, depends
from kvrelay.shared.config.declare import CONFIG, ExistingDir, Port, RedisUrl, setting
from kvrelay.shared.wire.redis_keys import STREAM_MAXLEN

ADMIN_KEY_ENV = "KVRELAY_ADMIN_KEY"
# prometheus_client's own variable: set before it is imported, every value lives in a file of that folder, which
# gateways sharing a port read together (gateway/metrics.py; kvrelay/metrics_dir.py makes it)
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
MAX_TOKENS_DEFAULT = 1024
WILDCARDS = ("0.0.0.0", "*", "::")


@dataclass(config=CONFIG)
class GatewayConfig:
    host: str = setting("127.0.0.1", "HTTP bind address (behind nginx by default; 0.0.0.0 to face clients)")
    port: Port = setting(8000, "HTTP port (0: one the kernel picks, logged at start)")
    redis_url: RedisUrl = common.redis_url()
    max_body_size: int = setting(1024 * 1024, "bytes; larger request bodies get 413", ge=1)
    request_timeout: float = setting(600.0, "seconds from arrival to the last token (a request whose model is "
                                     "being loaded again waits up to --model-load-timeout longer); the job's "
                                     "deadline on the workers is both together", gt=0)
    # Where workers send TokenBatches. Loopback unless configured; with a wildcard bind, workers on other
    # hosts need zmq_advertise_host, the name under which they can reach this gateway.
    zmq_host: str = setting("127.0.0.1", "where workers' token events arrive (bind address)")
    zmq_port: Port = setting(0, "port for token events (0: ephemeral)")
    zmq_advertise_host: str | None = setting(None, "the address workers dial for token events; required when "
                                             "--zmq-host is a wildcard")
    zmq_secret_file: str | None = common.zmq_secret_file()
    insecure_zmq: bool = common.insecure_zmq()
    zmq_secret: str | None = common.zmq_secret()
    stream_maxlen: int = setting(STREAM_MAXLEN, "XADD MAXLEN ~ of the per-model prefill streams", ge=1)
    registry_cache_s: float = setting(0.5, "seconds a Redis view of models and workers is reused across requests",
                                      ge=0)
    stalled_step_timeout_s: float = common.stalled_step_timeout()
    # The environment is the better place for it: argv shows in `ps` to every local user.
    admin_key: str | None = setting(None, f"bearer key of the /admin API; also makes the API require tenant keys "
                                    f"(default: ${ADMIN_KEY_ENV})", secret=True, env=ADMIN_KEY_ENV, min_length=16)
    response_cache_ttl: float = setting(0.0, "seconds a deterministic (temperature 0 or seeded) response is "
                                        "reused (0: off)", ge=0)
    response_cache_max_bytes: int = setting(1024 * 1024, "larger responses are not cached (with "
                                              "--response-cache-ttl)", ge=0)
    # vLLM's flag and default: usage.prompt_tokens_details is null unless asked for, as clients written for vLLM
    # expect; with it, {"cached_tokens": N} (OpenAI's shape)
    enable_prompt_tokens_details: bool = setting(False, "report usage.prompt_tokens_details.cached_tokens "
                                                 "(prompt tokens served from the prefix cache)")
    # vLLM's flag and default. -1 in a request asks for the whole vocabulary, which is that many logprobs per token
    max_logprobs: int = setting(20, "most logprobs (or top_logprobs, prompt_logprobs) a request may ask for per "
                                "token, -1 counting as the vocabulary's size; -1: no bound", ge=-1)
    # vLLM's flag: what a request's return_tokens_as_token_ids asks for, for every request
    return_tokens_as_token_ids: bool = setting(False, "logprobs name every token 'token_id:N' (as a request's "
                                               "return_tokens_as_token_ids does), for tokens whose text loses bytes")
    usage_retention_s: int = setting(35 * 86400, "seconds per-minute usage buckets are kept", ge=60)
    queue_metrics_cache_s: float = setting(1.0, "/metrics reads the queues from Redis at most this often", ge=0)
    metrics_tenant_labels: bool = common.metrics_tenant_labels()
    retry_after_s: int = setting(5, "Retry-After on 503 when no worker can serve the model", ge=0)
    default_tenant: str = setting("default", "whose requests these are while no tenant exists (open mode)",
                                  min_length=1)
    disconnect_poll_s: float = setting(1.0, "how often a waiting request checks that its client is still there",
                                       gt=0)
    drain_timeout: float = common.drain_timeout()
    reuse_port: bool = setting(False, "bind with SO_REUSEPORT, so several gateway processes serve one port")
    # vLLM's flag, kept by name so its deployments' command lines carry over (the server here is aiohttp): behind
    # nginx, which logs every request itself, the gateway's own line per request is CPU spent twice
    disable_uvicorn_access_log: bool = setting(False, "no access log line per HTTP request")
    # Slow clients (gateway/connection_guard.py). The keep-alive default outlasts clients' pools (httpx 5 s,
    # nginx 60 s), so a reused connection is not closed under a request already on its way.
    timeout_keep_alive: float = setting(75.0, "seconds an idle keep-alive connection stays open", gt=0)
    timeout_header_read: float = setting(10.0, "seconds a client has to send a request's headers (from connecting, "
                                         "or from the request's first byte); slower ones are disconnected", gt=0)
    timeout_body_read: float = setting(30.0, "seconds a client has to send a request's body once its headers are "
                                       "in; slower ones get 408 and are disconnected", gt=0)
    limit_idle_connections: int = setting(512, "connections with no request being handled (idle, or sending "
                                          "headers) past which the longest idle are closed", ge=1)
    # The stream's length is the backlog: workers delete what they ACK.
    max_queue_depth: int = setting(4096, "jobs queued per model past which new requests get 429 + Retry-After "
                                   "(0: unbounded)", ge=0)
    redis_watch_s: float = setting(0.5, "how often the gateway checks that Redis is the same server", gt=0)
    redis_outage_s: float = setting(3.0, "seconds Redis is unreachable (or, restarted, cannot say which queued "
                                         "jobs it kept) before those jobs count as lost", gt=0)
    # Redis replicates asynchronously: a job the master acknowledged may be missing on the replica a failover
    # promotes. WAIT after the job writes (on their connection) holds the request until that many replicas
    # have them, or the timeout passes; the request goes on either way, and a write fewer replicas confirmed
    # is counted (kvrelay_job_writes_unreplicated_total).
    redis_min_replicas: int = setting(0, "replicas that must confirm a request's job writes (Redis WAIT) before it "
                                      "waits for a worker; 0: no wait (README: Redis behind Sentinel)", ge=0)
    redis_replica_wait_ms: int = setting(100, "milliseconds a job write waits for --redis-min-replicas before the "
                                         "request goes on without them (with --redis-min-replicas)", ge=1)
    # Prefix affinity (gateway/control/routing.py): a prompt goes to the prefill worker that likely caches its
    # first affinity_prefix_tokens, unless that worker has more than affinity_slack requests more than
    # the least-loaded one; then to the shared stream, which the first free worker takes from.
    prefix_affinity: bool = setting(True, "send prompts sharing a prefix to the prefill worker that has it cached")
    affinity_slack: int = setting(8, "requests more than the least-loaded prefill worker past which affinity "
                                  "yields (with prefix affinity)", ge=0)
    affinity_prefix_tokens: int = setting(256, "leading prompt tokens (whole KV blocks) that decide a prompt's "
                                          "worker (with prefix affinity)", ge=1)
    # None: registering models through the API is off. Workers read weights from their own --model-repo.
    model_repo: ExistingDir | None = common.model_repo()
    model_load_timeout: float = setting(120.0, "seconds a request for a registered but unloaded model waits for "
                                        "its load", gt=0)
    reconcile_interval_s: float = setting(5.0, "how often one gateway loads missing pinned/min-replica models, "
                                          "ends finished swaps and gives model records an older kvrelay left "
                                          "without a TTL one (0: off, prewarm too); each gateway's prewarm, which "
                                          "loads models whose queues hold jobs while no worker holds them, runs "
                                          "every second or this often if shorter", ge=0)
    generation_config: Literal["auto", "vllm"] = setting(
        "auto", "defaults of what a request leaves out: auto takes temperature, top_p, top_k, min_p, "
        "repetition_penalty and max_new_tokens (as max_tokens) from the model's generation_config.json where it "
        "sets them; vllm ignores the file (temperature 1, top_p 1, ...)")
    max_tokens_default: int = setting(
        MAX_TOKENS_DEFAULT, "the most tokens a chat completion that sets no max_tokens generates (lower: the "
        "model's max_new_tokens, or the context the prompt leaves); 0: the rest of the context, as vLLM, which "
        "a small model sampled at temperature 1 may ramble to for minutes", ge=0)
    # vLLM's names and meaning: auto tool choice is off unless both are set (gateway/api/tool_parsers.py)
    enable_auto_tool_choice: bool = setting(False, "let the model decide when to call tools (tool_choice \"auto\", "
                                            "the default when a request has tools); needs --tool-call-parser")
    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] | None = setting(
        None, "how the served models write tool calls: hermes (<tool_call>{...}</tool_call>: Hermes, Qwen2.5, "
        "Qwen3), llama3_json (a JSON object: Llama 3.1+), mistral ([TOOL_CALLS][...])")
    # No flags: kvrelay serve fills them in from --model or --config, so /ready knows what to wait for before
    # any worker registers (served names; startup ones need live workers, lazy ones a registration).
    startup_models: list[str] = field(default_factory=list)
    lazy_models: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (how the model writes its calls)")
        depends.check(self, NEEDS)

    @property
    def reply_host(self) -> str:
        if self.zmq_advertise_host:
            return self.zmq_advertise_host
        if self.zmq_host in WILDCARDS:
            raise ValueError("zmq_host is a wildcard: set zmq_advertise_host to an address workers can reach")
        return self.zmq_host


def _no_affinity(config: GatewayConfig) -> str:
    return "" if config.prefix_affinity else "only with prefix affinity (--no-prefix-affinity routes no prompt by it)"


# settings that only another setting's value makes take effect (shared/config/depends.py)
NEEDS = (
    depends.Needs(("response_cache_max_bytes",), lambda c: "" if c.response_cache_ttl else
                  "only with --response-cache-ttl above 0 (0: no response is cached)"),
    depends.Needs(("redis_replica_wait_ms",), lambda c: "" if c.redis_min_replicas else
                  "only with --redis-min-replicas above 0 (0: no job write waits for replicas)"),
    depends.Needs(("affinity_slack",), _no_affinity),
    depends.Needs(("affinity_prefix_tokens",), _no_affinity),
)
