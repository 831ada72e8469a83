"""What ``kvrelay serve`` checks before it starts any process: that every fixed port it would bind is free,
and that an external Redis answers. Each failure is one line naming the flag and the cause (exit 2), said
within seconds, rather than children that fail one after the other and a supervisor that restarts them."""

import json
import socket
from collections.abc import Iterator
from pathlib import Path

from kvrelay.serve_config import ServedModel
from kvrelay.serve_plan import Child
from kvrelay.shared.engine.quant.config import choose
from kvrelay.shared.wire import redis_sentinel
from kvrelay.shared.wire.redacted_url import redact
from kvrelay.shared.wire.redis_cluster import is_cluster_url

REDIS_CHECK_TIMEOUT_S = 3.0


class StartupError(Exception):
    """serve could not start: the message is the whole line after ``kvrelay serve: error:``."""


def check_ports(children: list[Child]) -> None:
    """Bind each fixed port (as the child would, SO_REUSEADDR on) and let it go again. A gateway port
    shared with SO_REUSEPORT (--api-server-count) is checked once, without it: another server there is
    still refused."""
    for flag, host, port in _fixed_ports(children):
        try:
            infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as exc:
            raise StartupError(f"{flag} {port}: cannot resolve host {host!r} ({exc.strerror})") from None
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                raise StartupError(f"{flag} {port}: cannot bind {host}:{port} ({exc.strerror or exc}); "
                                   "is another server running there?") from None


def _fixed_ports(children: list[Child]) -> Iterator[tuple[str, str, int]]:
    gateways = [c.config for c in children if c.is_gateway]
    if gateways and gateways[0].port:
        yield "--port", gateways[0].host, gateways[0].port
    for g in gateways:
        if g.zmq_port:
            yield "--zmq-port", g.zmq_host, g.zmq_port
    for w in (c.config for c in children if not c.is_gateway):
        if w.port:
            yield "--worker-port", w.host, w.port
        if w.monitoring_port:
            yield "--worker-monitoring-port", w.host, w.monitoring_port


def check_quantization(models: list[ServedModel], flag: str | None, config_file: str | None) -> None:
    """Each model's quantization (its own in the config file, else --quantization) against its checkpoint's
    ``quantization_config``: a contradiction, or a 4-bit method without a 4-bit checkpoint, is said here
    rather than by every worker failing to load it. Shapes and the GPU are checked where the model loads."""
    for i, m in enumerate(models):
        requested = m.quantization or flag
        where = f"{config_file}: models[{i}].quantization" if m.quantization else "argument --quantization"
        dummy = m.path.startswith("dummy:")
        config_path = Path(m.path) / "config.json"
        if not dummy and not config_path.is_file():
            continue  # a .gguf imports later; a missing model is said where --model is resolved
        try:
            choose(requested, {} if dummy else json.loads(config_path.read_text()), dummy)
        except (ValueError, OSError) as exc:
            raise StartupError(f"{where}: {m.name}: {exc}") from None


def check_redis(url: str) -> None:
    """One PING, password included, with a short timeout: an external Redis that is down, or refuses the
    credentials, is said at once instead of by every child in turn."""
    # here, not at the top: every process kvrelay starts imports this module (kvrelay/cli.py), and one that
    # only reads a config (--help, --print-config) has no use for redis-py
    import redis

    from kvrelay.shared.wire import redis_sentinel_client
    from kvrelay.shared.wire.redis_conn import sync_client

    timeouts = {"socket_connect_timeout": REDIS_CHECK_TIMEOUT_S, "socket_timeout": REDIS_CHECK_TIMEOUT_S}
    try:
        # a cluster client reads the slot map as it is made: an unreachable cluster fails here
        if is_cluster_url(url):
            client = sync_client(url)
        elif redis_sentinel.is_sentinel_url(url):  # the sentinels name the master, then the master answers
            client = redis_sentinel_client.sync_client(url, **timeouts)
        else:
            client = redis.Redis.from_url(url, **timeouts)
    except redis.RedisError as exc:
        cause = " ".join(str(exc).split()) or type(exc).__name__
        raise StartupError(f"--redis-url {redact(url)}: Redis unreachable ({cause})") from None
    try:
        client.ping()
    except redis.RedisError as exc:
        cause = " ".join(str(exc).split()) or type(exc).__name__
        raise StartupError(f"--redis-url {redact(url)}: Redis unreachable ({cause})") from None
    finally:
        client.close()
