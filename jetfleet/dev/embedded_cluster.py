"""A 3-node nats-server cluster on loopback, from the pinned binary, for the failover
tests and ``jetfleet dev --cluster 3``.

Each node has its own store folder, a unique ``server_name``, JetStream with
``sync_interval: always`` (what docs/cluster.md asks of production), routes to the
others on ports from ``free_port`` (a route port must be known before any node starts),
its client and monitoring ports chosen by the server itself (``-1``, read back from its
log), and the same auth include a single embedded server gets. ``start`` returns once
every node answers and all of them name one JetStream meta leader: before that a stream
cannot be created.

Never production: there, run the official nats-server on separate hosts (docs/deploy.md).
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

from jetfleet.dev.embedded import EmbeddedServer, find_nats_server, free_port
from jetfleet.errors import StackError

CLUSTER_SIZES = (3,)
"""Node counts a dev cluster may have: 3, the least that survives losing one node."""
_ASK_TIMEOUT_S = 1.0


class ClusterNode(EmbeddedServer):
    """One nats-server of an ``EmbeddedCluster``."""

    def __init__(self, data_dir: Path, index: int, server_name: str) -> None:
        super().__init__(f"nats-{index + 1}", data_dir)
        self.index = index
        self.server_name = server_name
        self.route_port = 0
        self.monitor_port = 0

    @property
    def url(self) -> str:
        """The nats:// URL of this node's client port."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def monitor_url(self) -> str:
        """Its HTTP monitoring endpoint (``/varz``, ``/jsz``, ``/healthz``)."""
        return f"http://127.0.0.1:{self.monitor_port}"

    @property
    def running(self) -> bool:
        """The process is alive."""
        return self.process is not None and self.process.poll() is None

    def spawn(self, config: str) -> None:
        """Write ``config`` and start the process (readiness is the caller's wait)."""
        conf = self.data_dir / "nats-server.conf"
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text(config)
        if self.log_path.exists():
            self.log_path.unlink()
        self._spawn([str(find_nats_server()), "-c", str(conf)])

    def wait_ready(self, timeout_s: float) -> None:
        """Until it listens for clients and its monitor; learns both ports."""
        client = self._wait_for_log(r"Listening for client connections on [^\n]*:(\d+)", timeout_s)
        monitor = self._wait_for_log(r"Starting http monitor on [^\n]*:(\d+)", timeout_s)
        self._wait_for_log(r"Server is ready", timeout_s)
        self.port, self.monitor_port = int(client.group(1)), int(monitor.group(1))

    def jsz(self) -> dict[str, object] | None:
        """The node's ``/jsz`` answer, or None when it does not answer."""
        try:
            with urllib.request.urlopen(self.monitor_url + "/jsz", timeout=_ASK_TIMEOUT_S) as r:
                answer: dict[str, object] = json.loads(r.read())
                return answer
        except (OSError, ValueError):
            return None

    def healthy(self) -> bool:
        """``/healthz`` answers 200: JetStream is up here and its streams and consumers
        have caught up with their leaders (a restarted node serves reads only then)."""
        try:
            with urllib.request.urlopen(self.monitor_url + "/healthz", timeout=_ASK_TIMEOUT_S) as r:
                return bool(r.status == 200)
        except (OSError, ValueError):  # urllib's HTTPError (503) is an OSError
            return False


class EmbeddedCluster:
    """Three nats-server processes routed into one JetStream cluster under ``data_dir``.

    ``kill(i)`` and ``restart(i)`` play a node crashing and coming back (on the same
    client port, so the seed URLs stay right, with its store as it was).
    """

    def __init__(
        self,
        data_dir: Path,
        size: int = 3,
        auth_include: Path | None = None,
        sync_always: bool = True,
    ) -> None:
        if size not in CLUSTER_SIZES:
            raise StackError(f"a dev cluster has 3 nodes, not {size}")
        self.data_dir = data_dir
        self.auth_include = auth_include
        """An ``authorization {}`` file (``jetfleet auth init``) every node includes."""
        self.sync_always = sync_always
        """``sync_interval: always`` on every node; False (the server's default, a sync
        every 2 minutes) only for tests of the durability checks."""
        self.name = f"jf-{os.getpid()}-{id(self) % 100000}"
        self.nodes = [
            ClusterNode(data_dir / f"n{i + 1}", i, f"{self.name}-n{i + 1}") for i in range(size)
        ]

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated: the ``nats.url`` of a client."""
        return ",".join(node.url for node in self.nodes)

    @property
    def replicas(self) -> int:
        """Copies of each stream the cluster holds (``nats.replicas``): one per node."""
        return len(self.nodes)

    @property
    def monitor_urls(self) -> list[str]:
        """Every node's monitoring endpoint."""
        return [node.monitor_url for node in self.nodes]

    def node_named(self, server_name: str) -> ClusterNode:
        """The node whose ``server_name`` this is (as stream_info's ``cluster.leader``).

        Raises:
            StackError: no node has that name.
        """
        for node in self.nodes:
            if node.server_name == server_name:
                return node
        raise StackError(f"no node of cluster {self.name} is named {server_name!r}")

    def start(self, timeout_s: float = 30.0, tries: int = 3) -> EmbeddedCluster:
        """Start every node and wait for one JetStream meta leader.

        Args:
            timeout_s: how long each wait may take (a node's start, the election).
            tries: how many sets of route ports to try (another process may take one
                between ``free_port`` and the bind).

        Raises:
            StackError: the cluster did not come up.
        """
        for attempt in range(tries):
            for node in self.nodes:
                node.port, node.monitor_port, node.route_port = 0, 0, free_port()
            for node in self.nodes:
                node.spawn(self._config(node))
            try:
                for node in self.nodes:
                    node.wait_ready(timeout_s)
                self.wait_meta_leader(timeout_s)
                return self
            except StackError:
                self.stop()
                if attempt == tries - 1:
                    raise
        raise StackError("unreachable")  # pragma: no cover

    def _config(self, node: ClusterNode) -> str:
        store = node.data_dir / "jetstream"
        routes = "\n".join(f'    "nats-route://127.0.0.1:{n.route_port}"' for n in self.nodes)
        include = ""
        if self.auth_include is not None:
            # nats-server reads an include path relative to the including file.
            conf_dir = node.data_dir.resolve()
            include = f'include "{os.path.relpath(self.auth_include.resolve(), conf_dir)}"\n'
        sync = "  sync_interval: always\n" if self.sync_always else ""
        # Client and monitor on -1 the first time (the server picks, no race); the same
        # ports again on a restart, so the clients' seed URLs still name the node.
        return (
            f'listen: "127.0.0.1:{node.port or -1}"\n'
            f'http: "127.0.0.1:{node.monitor_port or -1}"\n'
            f'server_name: "{node.server_name}"\n'
            f'jetstream {{\n  store_dir: "{store}"\n{sync}}}\n'
            f'cluster {{\n  name: "{self.name}"\n'
            f'  listen: "127.0.0.1:{node.route_port}"\n'
            # A node ignores the route to itself.
            f"  routes: [\n{routes}\n  ]\n}}\n"
            f"{include}"
        )

    def meta_leader(self) -> str:
        """The meta leader every running node names, once it sees every other running
        node as a current, online peer; "" before that.

        Agreeing on a leader is not enough: until the leader has heard from a peer, it
        places no R3 stream ("no suitable peers for placement, peer offline", seen on
        the chaos soak's first ``declare``)."""
        named = set()
        views: dict[str, object] = {}
        for node in self.nodes:
            if not node.running:
                continue
            jsz = node.jsz()
            meta = jsz.get("meta_cluster") if jsz else None
            leader = meta.get("leader", "") if isinstance(meta, dict) else ""
            if not leader:
                return ""
            named.add(leader)
            views[node.server_name] = meta
        if len(named) != 1:
            return ""
        leader = named.pop()
        return leader if _sees_peers(views.get(leader), len(views) - 1) else ""

    def wait_meta_leader(self, timeout_s: float = 30.0) -> str:
        """Until the running nodes agree on a JetStream meta leader; returns its name.

        Raises:
            StackError: none within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            leader = self.meta_leader()
            if leader:
                return leader
            time.sleep(0.05)
        raise StackError(
            f"cluster {self.name}: no JetStream meta leader within {timeout_s:g} s; see the "
            f"nodes' logs in {self.data_dir}/n*/"
        )

    def kill(self, index: int) -> None:
        """SIGKILL node ``index``: a crash, nothing flushed beyond what was synced."""
        self.nodes[index].kill()

    def restart(self, index: int, timeout_s: float = 30.0) -> None:
        """Start node ``index`` again on its old ports and store; wait until the cluster
        has a meta leader and the node has caught up (``/healthz``).

        Raises:
            StackError: it did not within ``timeout_s`` (each wait).
        """
        node = self.nodes[index]
        node.spawn(self._config(node))
        node.wait_ready(timeout_s)
        self.wait_meta_leader(timeout_s)
        deadline = time.monotonic() + timeout_s
        while not node.healthy():
            if time.monotonic() > deadline:
                raise StackError(
                    f"{node.server_name} did not catch up within {timeout_s:g} s; see "
                    f"{node.log_path}"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop every node (SIGTERM, then SIGKILL)."""
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                node.process.terminate()
        for node in self.nodes:
            node.stop()


def _sees_peers(meta: object, others: int) -> bool:
    """The meta leader's ``meta_cluster`` view lists ``others`` peers current and online."""
    replicas = meta.get("replicas") if isinstance(meta, dict) else None
    if not isinstance(replicas, list):
        return others == 0
    ready = [
        r
        for r in replicas
        if isinstance(r, dict) and r.get("current") and not r.get("offline", False)
    ]
    return len(ready) >= others
