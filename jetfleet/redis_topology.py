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

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialBackoff

from jetfleet.redis_url import RedisTopology, parse_redis_url

RedisClient = aioredis.Redis | RedisCluster
"""What jetfleet's Redis users hold: one server's client (also a Sentinel master's), or a
cluster's."""
TIMEOUT_S = 1.0
"""Socket and connect timeout, and how long a caller waits for a pooled connection."""
MAX_POOL_SIZE = 2048
"""The most connections a service's pool opens (per node of a cluster), however high its
``fleet.service_concurrency``: each is a file descriptor here and a client at Redis
(``maxclients``); calls past it wait their turn."""
CLUSTER_RETRIES = 2
"""Tries again after a connection error, each after re-reading the cluster's slots: a
moved slot is followed at once, a dead master is given up on quickly (redis-py's default
retries hid a killed master for 3 s inside one call)."""


def pool_size_for(least: int, callers: int) -> int:
    """A pool for ``callers`` concurrent calls: one connection each, at least ``least``
    and at most ``MAX_POOL_SIZE``."""
    return min(max(least, callers), MAX_POOL_SIZE)


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
    asked: dict[str, Any] = {"socket_timeout": TIMEOUT_S, "socket_connect_timeout": TIMEOUT_S}
    if topology.sentinel_password is not None:
        asked["password"] = topology.sentinel_password
        asked["username"] = topology.sentinel_username
    sentinel = Sentinel(list(topology.nodes), sentinel_kwargs=asked, **data)
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
