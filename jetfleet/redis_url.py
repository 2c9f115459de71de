"""What ``redis.url`` says: one server, a Redis Cluster, or a master watched by Sentinel
(the forms are in jetfleet/redis_topology.py, which connects to them).

Taking the URL apart needs no Redis client: settings validate it in every process,
the CLI included, and importing redis-py costs a third of a second there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import parse_qsl, unquote, urlsplit

from jetfleet.errors import ConfigError

RedisKind = Literal["single", "cluster", "sentinel"]

SINGLE_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_PORT = {"cluster": 6379, "sentinel": 26379}
FORMS = (
    "redis://host:6379/0, redis+cluster://host1:6379,host2:6379 or "
    "redis+sentinel://sentinel1:26379,sentinel2:26379/SERVICE"
)


@dataclass(frozen=True)
class RedisTopology:
    """``redis.url`` taken apart."""

    kind: RedisKind
    url: str
    nodes: tuple[tuple[str, int], ...] = ()
    """The cluster's startup nodes, or the Sentinels (empty for one server)."""
    service: str = ""
    """The master's name at the Sentinels."""
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    sentinel_username: str | None = None
    """The Sentinels' own user (``?sentinel_username=``), when they have ACLs."""
    sentinel_password: str | None = None
    """The Sentinels' own password (``?sentinel_password=``: their ``requirepass``), when
    they have one; the URL's user and password are the data nodes'."""


def parse_redis_url(url: str) -> RedisTopology:
    """Take ``url`` apart.

    Raises:
        ConfigError: it is none of the forms above, saying what to fix.
    """
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme in SINGLE_SCHEMES:
        return RedisTopology(kind="single", url=url)
    if scheme not in CLUSTER_SCHEMES + SENTINEL_SCHEMES:
        raise ConfigError(
            f"redis.url {_shown(url)!r}: unknown scheme {scheme!r}; give one of {FORMS} "
            "(rediss for TLS)"
        )
    kind: RedisKind = "cluster" if scheme in CLUSTER_SCHEMES else "sentinel"
    parts = urlsplit(url)
    if parts.fragment or (parts.query and kind == "cluster"):
        raise ConfigError(f"redis.url {_shown(url)!r}: a {kind} URL takes no ?options or #")
    sentinel_auth = _sentinel_auth(parts.query, url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    user, has_password, password = userinfo.partition(":")
    nodes = tuple(_node(text, kind, url) for text in hosts.split(","))
    service, db = _path(parts.path, kind, url)
    return RedisTopology(
        kind=kind,
        url=url,
        nodes=nodes,
        service=service,
        db=db,
        username=unquote(user) or None,
        password=unquote(password) if has_password else None,
        tls=scheme.startswith("rediss"),
        sentinel_username=sentinel_auth.get("sentinel_username"),
        sentinel_password=sentinel_auth.get("sentinel_password"),
    )


SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")


def _sentinel_auth(query: str, url: str) -> dict[str, str]:
    """A Sentinel URL's ``?sentinel_username=&sentinel_password=`` (percent-encoded)."""
    wanted = (
        f"redis.url {_shown(url)!r}: a Sentinel URL takes only "
        "?sentinel_password=...[&sentinel_username=...] (the Sentinels' own credentials, "
        "percent-encoded), each once"
    )
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ConfigError(wanted) from None
    options: dict[str, str] = {}
    for name, value in pairs:
        if name not in SENTINEL_OPTIONS or name in options:
            raise ConfigError(f"{wanted}; not {name!r}")
        options[name] = value
    if "sentinel_username" in options and "sentinel_password" not in options:
        raise ConfigError(f"{wanted}; a sentinel_username needs its sentinel_password")
    return options


def _node(text: str, kind: RedisKind, url: str) -> tuple[str, int]:
    host, port = text, str(DEFAULT_PORT[kind])
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":") or port
    elif ":" in text:
        host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        what = "startup node" if kind == "cluster" else "Sentinel"
        raise ConfigError(
            f"redis.url {_shown(url)!r}: {text!r} is not a {what} host:port; list them "
            f"comma-separated, as in {FORMS}"
        )
    return host, int(port)


def _path(path: str, kind: RedisKind, url: str) -> tuple[str, int]:
    pieces = [p for p in path.split("/") if p]
    if kind == "cluster":
        if pieces not in ([], ["0"]):
            raise ConfigError(
                f"redis.url {_shown(url)!r}: a Redis Cluster has only database 0; "
                "end the URL after the nodes (or with /0)"
            )
        return "", 0
    if not pieces or len(pieces) > 2 or (len(pieces) == 2 and not pieces[1].isdigit()):
        raise ConfigError(
            f"redis.url {_shown(url)!r}: name the master Sentinel watches after the "
            "Sentinels, and optionally its database: "
            "redis+sentinel://host1:26379,host2:26379/SERVICE[/db]"
        )
    return unquote(pieces[0]), int(pieces[1]) if len(pieces) == 2 else 0


def _shown(url: str) -> str:
    """``url`` without its passwords, for an error message."""
    head, sep, rest = url.partition("://")
    rest, mark, query = rest.partition("?")
    if mark:
        query = "&".join(
            "sentinel_password=***" if part.startswith("sentinel_password=") else part
            for part in query.split("&")
        )
    if "@" in rest.split("/", 1)[0]:
        rest = rest.split("@", 1)[1]
    return head + sep + rest + mark + query
