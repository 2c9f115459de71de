"""Where Redis is: one server, a Redis Cluster, or a master watched by Sentinel.

``redis.url`` (or ``REDIS_URL``) names it, in one of these forms:

- ``redis://[user:password@]host:port/db`` (``rediss://`` for TLS, ``unix://path``): one
  server, as always;
- ``redis+cluster://[user:password@]host:port,host:port,...``: a Redis Cluster, the
  listed nodes being where the client starts (any few of them; it learns the rest). A
  cluster has only database 0, so the path is empty or ``/0``;
- ``redis+sentinel://[user:password@]host:port,host:port,.../SERVICE[/db]``: the master
  that the listed Sentinels name ``SERVICE``; the user and password are the data nodes'
  (the Sentinels are asked without any).

``rediss+cluster://`` and ``rediss+sentinel://`` connect to the data nodes with TLS.
Every client built here gives up within about a second: a caller that cannot get an
answer fails closed (the rate limiter refuses permits, the leaser grants), it never
waits for a failover to finish.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialBackoff

from jetfleet.errors import ConfigError

RedisClient = aioredis.Redis | RedisCluster
"""What jetfleet's Redis users hold: one server's client (also a Sentinel master's), or a
cluster's."""
RedisKind = Literal["single", "cluster", "sentinel"]

SINGLE_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_PORT = {"cluster": 6379, "sentinel": 26379}
TIMEOUT_S = 1.0
"""Socket and connect timeout, and how long a caller waits for a pooled connection."""
CLUSTER_RETRIES = 2
"""Tries again after a connection error, each after re-reading the cluster's slots: a
moved slot is followed at once, a dead master is given up on quickly (redis-py's default
retries hid a killed master for 3 s inside one call)."""
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
    if parts.query or parts.fragment:
        raise ConfigError(f"redis.url {_shown(url)!r}: a {kind} URL takes no ?options or #")
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
    )


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
    """``url`` without its password, for an error message."""
    head, sep, rest = url.partition("://")
    if "@" not in rest.split("/", 1)[0]:
        return url
    return head + sep + rest.split("@", 1)[1]


def connect_redis(url: str, pool_size: int) -> RedisClient:
    """A client for ``url`` (connects lazily, on its first command).

    One server: a blocking pool of ``pool_size`` connections (a caller waits up to a
    second for one: the default pool refuses at once past its size, which under a burst
    would fail calls closed for want of a connection, not of Redis). A cluster:
    ``pool_size`` connections per node. Sentinel: the master it names now, asked again
    whenever a connection to it fails.

    Raises:
        ConfigError: ``url`` is none of the accepted forms.
    """
    topology = parse_redis_url(url)
    if topology.kind == "cluster":
        return _cluster(topology, pool_size)
    if topology.kind == "sentinel":
        return _sentinel_master(topology, pool_size)
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=pool_size,
        timeout=TIMEOUT_S,
        socket_timeout=TIMEOUT_S,
        socket_connect_timeout=TIMEOUT_S,
    )
    return aioredis.Redis(connection_pool=pool)


def _cluster(topology: RedisTopology, pool_size: int) -> RedisCluster:
    return RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in topology.nodes],
        username=topology.username,
        password=topology.password,
        ssl=topology.tls,
        max_connections=pool_size,
        socket_timeout=TIMEOUT_S,
        socket_connect_timeout=TIMEOUT_S,
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), CLUSTER_RETRIES),
    )


class _BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """The Sentinel master's pool, waiting (up to a second) for a free connection like
    the one-server pool rather than refusing past its size."""


def _sentinel_master(topology: RedisTopology, pool_size: int) -> aioredis.Redis:
    data: dict[str, Any] = {
        "socket_timeout": TIMEOUT_S,
        "socket_connect_timeout": TIMEOUT_S,
        "db": topology.db,
        "username": topology.username,
        "password": topology.password,
    }
    if topology.tls:
        data["ssl"] = True
    sentinel = Sentinel(
        list(topology.nodes),
        sentinel_kwargs={"socket_timeout": TIMEOUT_S, "socket_connect_timeout": TIMEOUT_S},
        **data,
    )
    master: aioredis.Redis = sentinel.master_for(
        topology.service,
        connection_pool_class=_BlockingSentinelPool,
        max_connections=pool_size,
        timeout=TIMEOUT_S,
    )
    return master


async def close_redis(client: RedisClient) -> None:
    """Close ``client`` and everything it opened: a cluster's node connections, or the
    pool of one server (not closed with a client it was given to), and for a Sentinel's
    master the connections to the Sentinels as well."""
    if isinstance(client, RedisCluster):
        await client.aclose()
        return
    pool = client.connection_pool
    await client.aclose(close_connection_pool=True)
    if isinstance(pool, SentinelConnectionPool):
        await pool.sentinel_manager.aclose()
