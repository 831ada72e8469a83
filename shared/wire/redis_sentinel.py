"""Redis behind Sentinel: what a ``redis+sentinel://`` URL says.

    redis+sentinel://[USER:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/MASTER_NAME[/DB][?OPTIONS]
    rediss+sentinel://...   TLS to the Redis servers and to the sentinels alike

The grammar is the one other Python tools use for it (Prefect's and docket's ``redis+sentinel``): the hosts
are the sentinels (port 26379 unless given), the path names the master set as the sentinels know it, and
``USER:PASSWORD`` is the ACL user of the data servers, exactly as in a ``redis://`` URL. Sentinels that
ask for a password of their own (``requirepass`` / ``user`` lines in sentinel.conf) take it from the
``sentinel_username`` and ``sentinel_password`` options; a ``rediss+sentinel`` URL takes the TLS options
of a ``rediss://`` one, and they apply to both kinds of connection, so one private CA covers the whole
deployment.

The clients that follow the master through a failover are ``redis_sentinel_client.py``'s; no redis-py here: configs check their URLs wherever they
are read (``kvrelay --help``, ``--print-config``), which need no client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_PORT = 26379
SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")
# A sentinel that does not answer is skipped for the next one: a short timeout and no retries of its own
# (the data connection's retries ask all of them again), so one dead sentinel costs little per connect.
SENTINEL_TIMEOUT_S = 1.0


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SCHEMES


@dataclass(frozen=True)
class SentinelUrl:
    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    options: dict[str, str] = field(default_factory=dict)  # the query: sentinel_* and, with TLS, ssl_*

    def tls_kwargs(self) -> dict:
        """redis-py's keyword arguments for TLS, parsed as redis-py parses them in a ``rediss://`` URL."""
        if not self.tls:
            return {}
        from redis.connection import URL_QUERY_ARGUMENT_PARSERS  # a client is being made: redis-py is loaded

        out: dict = {"ssl": True}
        for name, value in self.options.items():
            if name.startswith("ssl_"):
                parser = URL_QUERY_ARGUMENT_PARSERS.get(name)
                out[name] = parser(value) if parser else value
        return out

    def sentinel_kwargs(self, retry: object) -> dict:
        return {"socket_connect_timeout": SENTINEL_TIMEOUT_S, "socket_timeout": SENTINEL_TIMEOUT_S,
                "username": self.options.get("sentinel_username") or None,
                "password": self.options.get("sentinel_password") or None, "retry": retry, **self.tls_kwargs()}

    def data_kwargs(self) -> dict:
        return {"db": self.db, "username": self.username, "password": self.password, **self.tls_kwargs()}


def parse(url: str) -> SentinelUrl:
    """The URL's parts; ValueError saying what is wrong with it (in one line, without the password)."""
    scheme, sep, _ = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise ValueError("must be a redis+sentinel:// or rediss+sentinel:// URL")
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ValueError(f"not a URL ({exc})") from None
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":") if userinfo else ("", "", "")
    sentinels = tuple(_host_port(h) for h in hosts.split(","))
    path = [unquote(p) for p in parts.path.split("/")[1:]]
    if not path or not path[0]:
        raise ValueError("no master name: redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER_NAME[/DB]")
    if len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"after the master name {path[0]!r} only a database number may follow (got "
                         f"{'/'.join(path[1:])!r})")
    options = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    return SentinelUrl(sentinels=sentinels, master=path[0], db=int(path[1]) if len(path) == 2 and path[1] else 0,
                       username=unquote(username) or None, password=unquote(password) or None,
                       tls=scheme.lower() == "rediss+sentinel", options=options)


def _host_port(text: str) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:PORT
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else rest
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host:
        raise ValueError(f"sentinel address {text!r} has no host (HOST[:PORT], comma-separated)")
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"sentinel address {text!r}: the port must be a number from 1 to 65535")
    return host, int(port) if port else DEFAULT_PORT

