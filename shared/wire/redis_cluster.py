"""What a Redis Cluster URL says: ``redis-cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]`` (``rediss-cluster://``
for TLS, with the query options a ``rediss://`` URL takes). The listed nodes are only where discovery starts
(``redis_cluster_client.py`` makes the clients). A cluster has one database, 0. No redis-py here: configs
check their URLs wherever they are read (``kvrelay --help``, ``--print-config``), which need no client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

SCHEMES = ("redis-cluster", "rediss-cluster")
_BOOL = {"true": True, "false": False}


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0] in SCHEMES


@dataclass
class ClusterUrl:
    nodes: list[tuple[str, int]]
    username: str | None = None
    password: str | None = None
    tls: bool = False
    tls_options: dict[str, str | bool] = field(default_factory=dict)


def parse(url: str) -> ClusterUrl:
    """The nodes, credentials and TLS options of a cluster URL; ValueError saying what is wrong."""
    scheme, sep, _ = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError("a cluster URL starts with redis-cluster:// or rediss-cluster://")
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username, password = (unquote(user) or None), (unquote(pw) if colon else None)
    nodes = []
    for item in hosts.split(","):
        host, colon, port = item.strip().rpartition(":")
        host = host.strip("[]")  # an IPv6 address: [::1]:7000
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"cluster node {item!r} is not HOST:PORT")
        nodes.append((host, int(port)))
    if parts.path not in ("", "/", "/0"):
        raise ValueError(f"a cluster has one database, 0 (the URL names {parts.path.lstrip('/')!r})")
    options: dict[str, str | bool] = {}
    for name, values in parse_qs(parts.query, keep_blank_values=True).items():
        options[name] = _BOOL.get(values[-1].lower(), values[-1]) if name == "ssl_check_hostname" else values[-1]
    if options and scheme != "rediss-cluster":
        raise ValueError("only rediss-cluster:// takes URL parameters (TLS options)")
    if "ssl_ca_path" in options:  # redis-py's asyncio cluster client has no such option
        raise ValueError("ssl_ca_path: a cluster URL takes ssl_ca_certs (one CA file) instead")
    return ClusterUrl(nodes, username, password, scheme == "rediss-cluster", options)

