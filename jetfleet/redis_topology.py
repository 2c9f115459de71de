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
Every client built here gives up on a round trip within about a second: a caller that
cannot get an answer fails closed (the rate limiter refuses permits, the leaser grants),
it never waits for a failover to finish. A caller queued behind a full pool waits its
turn instead, about a second per pool's worth of callers ahead (``pool_wait_s``).
"""

from __future__ import annotations

import math
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
"""Socket and connect timeout, and a caller's wait for a pooled connection per pool's
worth of callers that may be ahead of it (``pool_wait_s``)."""
CLUSTER_RETRIES = 2
"""Tries again after a connection error, each after re-reading the cluster's slots: a
moved slot is followed at once, a dead master is given up on quickly (redis-py's default
retries hid a killed master for 3 s inside one call)."""


def pool_wait_s(pool_size: int, callers: int) -> float:
    """How long a caller waits for a pooled connection when up to ``callers`` call at
    once: a second per round of ``pool_size`` callers. With a second in all, a burst of
    four pools' worth (a leaser's 512 grants against 128 connections) refused its last
    callers on a loaded machine, with Redis healthy; each round trip is itself bounded
    by the socket timeout, so the wait still ends when Redis hangs."""
    return TIMEOUT_S * max(1, math.ceil(callers / pool_size))


def connect_redis(url: str, pool_size: int, callers: int = 0) -> RedisClient:
    """A client for ``url`` (connects lazily, on its first command), for up to
    ``callers`` concurrent callers (0: ``pool_size``).

    One server: a blocking pool of ``pool_size`` connections (a caller waits its turn,
    ``pool_wait_s``: the default pool refuses at once past its size, which under a burst
    would fail calls closed for want of a connection, not of Redis). A cluster:
    ``pool_size`` connections per node, or ``callers`` if more (redis-py's cluster
    client cannot queue a caller: past its size it refuses at once). Sentinel: the
    master it names now, asked again whenever a connection to it fails, with the
    one-server pool's wait.

    Raises:
        ConfigError: ``url`` is none of the accepted forms.
    """
    topology = parse_redis_url(url)
    wait_s = pool_wait_s(pool_size, callers or pool_size)
    if topology.kind == "cluster":
        return _cluster(topology, max(pool_size, callers))
    if topology.kind == "sentinel":
        return _sentinel_master(topology, pool_size, wait_s)
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=pool_size,
        timeout=wait_s,
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
    """The Sentinel master's pool, waiting its turn for a free connection like the
    one-server pool rather than refusing past its size."""


def _sentinel_master(topology: RedisTopology, pool_size: int, wait_s: float) -> aioredis.Redis:
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
        timeout=wait_s,
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
