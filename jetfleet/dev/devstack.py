"""The embedded default: every part of the fleet on loopback, in one data folder.

``DevStack`` starts nats-server and redis-server (from the pinned wheels) on free ports,
the target simulator (declared as target ``demo``), every service and N workers as child
processes, writes ``DIR/jetfleet.toml`` and ``DIR/env``, and stops all of it on ``stop()``.
``start()`` returns, and the env file appears, only once the topology is declared and
every child answers, so a job published at that moment is stored and run.
Children are started with a parent-death signal, so even a killed ``jetfleet dev`` leaves
no process behind.

``service_replicas`` runs that many processes of every service (``sink``, ``sink-2``, ...;
each gateway on a port of its own); ``kill`` crashes any one child and ``start_again``
brings it back as it was, as a supervisor would (tests/test_replicated_services.py,
bench/chaos.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import tomllib
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from jetfleet.auth.bundle import NATS_AUTH_FILE, REDIS_ACL_FILE, ensure_bundle
from jetfleet.connection import connect_nats
from jetfleet.dev.embedded import EmbeddedNats, EmbeddedRedis, die_with_parent, free_port
from jetfleet.dev.embedded_cluster import EmbeddedCluster
from jetfleet.dev.readiness import READY_TIMEOUT_S, wait_answering
from jetfleet.dev.settings_file import toml_tables
from jetfleet.dev.site_loop import SiteLoop
from jetfleet.dev.stack_env import write_env
from jetfleet.errors import StackError
from jetfleet.services import SERVICE_NAMES
from jetfleet.settings import Settings, load_settings
from jetfleet.simulator import SimulatorConfig, TargetSimulator
from jetfleet.topology import declare

log = logging.getLogger(__name__)

# Longer than a service's own drain (30 s), so a draining child is not killed mid-drain.
STOP_TIMEOUT_S = 35.0
DEV_WORKER_CONCURRENCY = 32
"""Jobs at once per lane for `jetfleet dev`'s own workers (the production default,
``worker.concurrency``, is 8). With 8, two workers hold 16 jobs at once, and the demo
target's light jobs wait on round trips: the noop path ran at about half the jobs/s and
spent 27 % more CPU per job than with 32 (docs/benchmarks.md). The target's
``max_in_flight`` (64 here) still caps the fleet."""


class NatsServers(Protocol):
    """The NATS a stack runs on: its one embedded server (``EmbeddedNats``), or a cluster
    of them built by a ``NatsFactory``."""

    @property
    def replicas(self) -> int:
        """Copies of each stream the servers hold (``nats.replicas``): 1 on one server."""
        ...

    @property
    def url(self) -> str:
        """What clients connect to (a cluster: its seed URLs, comma-separated)."""
        ...

    def start(self) -> object:
        """Start and wait until clients can connect."""
        ...

    def stop(self) -> None:
        """Stop every server."""
        ...


NatsFactory = Callable[[Path, Path], NatsServers]
"""``(folder for the servers' stores and logs, the auth include file every server must
include) -> the servers, not started``."""


@dataclass(frozen=True)
class ScriptedTarget:
    """A further target of the stack, played by a simulator of its own (so its requests
    per second are counted apart from every other target's).

    Attributes:
        config: How the simulator behaves (latency, a 429 storm, ...).
        table: The ``[targets.NAME]`` keys besides ``base_url`` (rate, burst, ...).
    """

    config: SimulatorConfig
    table: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerSpec:
    """One worker child: its id, the identity it owns, its targets ("" for all) and
    variables added to its environment (a version tuple field, a skewed clock)."""

    id: str
    identity: str = ""
    targets: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    module: str = "jetfleet"
    """What ``python -m`` runs: ``jetfleet``, or a module that runs the jetfleet command
    with a test-only worker variant (tests/faults/ack_dropping_worker.py)."""

    def argv(self) -> list[str]:
        """``jetfleet worker`` arguments for this worker."""
        args = ["worker", "--id", self.id]
        if self.identity:
            args += ["--identity", self.identity]
        if self.targets:
            args += ["--targets", ",".join(self.targets)]
        return args


class DevStack:
    """One local fleet in ``data_dir``; ``async with DevStack(...)`` starts and stops it."""

    def __init__(
        self,
        data_dir: Path,
        workers: int = 2,
        user_config: Path | None = None,
        simulator_latency_s: float = 0.0,
        trace_endpoint: str = "",
        scripted_targets: Mapping[str, ScriptedTarget] | None = None,
        worker_specs: Sequence[WorkerSpec] = (),
        demo_table: Mapping[str, Any] | None = None,
        sites_on_own_loop: bool = False,
        cluster: int = 0,
        service_replicas: int = 1,
        nats_sync_always: bool = False,
        nats_servers: NatsFactory | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
    ) -> None:
        if service_replicas < 1:
            raise StackError(f"service_replicas must be at least 1, not {service_replicas}")
        self.data_dir = data_dir.resolve()
        self.ready_timeout_s = ready_timeout_s
        """How long children get to answer (``start``, ``add_worker``, ``start_again``): a
        child answers once it has imported, connected and started, and on a machine
        loaded far past its cores (the chaos soak beside a test suite, load 20 on 2
        cores) 18 children starting at once wrote no log line within 60 s."""
        self.trace_endpoint = trace_endpoint
        """An OTLP/HTTP base URL (Jaeger's :4318) every child exports its spans to; empty:
        the children get the caller's own ``OTEL_*`` variables, if any."""
        self.workers = workers
        self.user_config = user_config
        self.auth_dir = self.data_dir / "auth"
        """Every role's credentials (``jetfleet auth init``), kept across restarts."""
        self.cluster = cluster
        """0: one embedded nats-server (R1, default sync), or what ``nats_servers`` builds;
        3: a 3-node cluster on loopback (R3, ``sync_interval: always``), as production
        runs (docs/cluster.md)."""
        self.nats: NatsServers
        if cluster:
            self.nats = EmbeddedCluster(
                self.data_dir / "nats-cluster",
                size=cluster,
                auth_include=self.auth_dir / NATS_AUTH_FILE,
            )
        else:
            self.nats = (nats_servers or _one_server(nats_sync_always))(
                self.data_dir / "nats", self.auth_dir / NATS_AUTH_FILE
            )
        self.redis = EmbeddedRedis(self.data_dir / "redis", acl_file=self.auth_dir / REDIS_ACL_FILE)
        self.gateway_token = ""
        self.simulator = TargetSimulator(SimulatorConfig(latency_s=simulator_latency_s))
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.ready_urls: dict[str, str] = {}
        self._log_starts: dict[str, int] = {}
        """Each child's log size when it was last spawned: its metrics line comes after."""
        """Each child's loopback URL that answers 200 once it has started."""
        self.gateway_port = 0
        self.settings: Settings | None = None
        self.scripted = dict(scripted_targets or {})
        """Targets beyond ``demo``, each on its own simulator (``simulators``)."""
        self.simulators = {
            name: TargetSimulator(target.config) for name, target in self.scripted.items()
        }
        self.worker_specs = tuple(worker_specs)
        """Workers started beside the ``workers`` plain ones."""
        self.demo_table = dict(demo_table or {})
        """Keys of ``[targets.demo]`` that replace the defaults (rate, burst, ...)."""
        self.service_replicas = service_replicas
        """How many processes run each service: ``NAME``, then ``NAME-2``, ``NAME-3``..."""
        self.killed: set[str] = set()
        """Children ended on purpose by ``kill``: not counted as dead."""
        self._launches: dict[str, tuple[list[str], dict[str, str], str]] = {}
        """Each child's arguments, extra environment and module, to start it again."""
        self.site_loop = SiteLoop() if sites_on_own_loop else None
        """Where the simulators run when not on the caller's loop (jetfleet/dev/site_loop.py):
        for a caller that measures their request rates while busy itself."""

    @property
    def config_path(self) -> Path:
        """The generated configuration every child reads."""
        return self.data_dir / "jetfleet.toml"

    @property
    def gateway_url(self) -> str:
        """The gateway's base URL."""
        return f"http://127.0.0.1:{self.gateway_port}"

    async def __aenter__(self) -> DevStack:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _all_sites(self) -> list[TargetSimulator]:
        return [self.simulator, *self.simulators.values()]

    async def _on_site_loop(self, step: Coroutine[Any, Any, object]) -> None:
        """Run a simulator's start or stop where the simulators live."""
        if self.site_loop is None:
            await step
        else:
            await self.site_loop.run(step)

    async def start(self) -> None:
        """Start servers, simulator, services and workers; write the config; declare the
        topology; wait until every child answers; then write the env file.

        Raises:
            StackError: a server or child failed to start, or a child did not answer.
        """
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._claim_folder()
        try:
            # Auth is on, as in production: each child connects as its own role.
            self.gateway_token = ensure_bundle(self.auth_dir).gateway_token
            await asyncio.to_thread(self.nats.start)
            await asyncio.to_thread(self.redis.start)
            for sim in self._all_sites():
                await self._on_site_loop(sim.start())
            self.gateway_port = free_port()
            self._write_config()
            self.settings = load_settings(self.config_path, {})
            await self._declare_topology(self.settings)
            for name in SERVICE_NAMES:
                for replica in range(1, self.service_replicas + 1):
                    self._spawn_service(name, replica)
            plain = self._plain_worker_env()
            for n in range(self.workers):
                self._spawn(f"worker-{n}", ["worker", "--id", f"w-{n}"], plain)
            for spec in self.worker_specs:
                self._spawn(f"worker-{spec.id}", spec.argv(), spec.env, spec.module)
            await self._wait_answering(list(self.children))
            self._write_env()
        except BaseException:
            await self.stop()
            raise

    def _plain_worker_env(self) -> dict[str, str]:
        """What the stack's own workers (``workers``, not ``worker_specs``) run with:
        ``DEV_WORKER_CONCURRENCY`` jobs at once per lane, unless the user's config sets
        ``[worker] concurrency``."""
        user = tomllib.loads(self.user_config.read_text()) if self.user_config else {}
        if "concurrency" in user.get("worker", {}):
            return {}
        return {"JETFLEET_WORKER__CONCURRENCY": str(DEV_WORKER_CONCURRENCY)}

    def _claim_folder(self) -> None:
        pid_file = self.data_dir / "dev.pid"
        if pid_file.exists():
            try:
                pid = int(pid_file.read_text().strip())
                os.kill(pid, 0)
            except (ValueError, ProcessLookupError, PermissionError):
                pass  # a stale file from a stack that died
            else:
                if pid != os.getpid():
                    raise StackError(
                        f"a dev stack (pid {pid}) already runs in {self.data_dir}: stop it, "
                        "or start this one with another --data folder"
                    )
        pid_file.write_text(str(os.getpid()))

    def _write_config(self) -> None:
        user: dict[str, Any] = {}
        if self.user_config is not None:
            user = tomllib.loads(self.user_config.read_text())
        targets = dict(user.get("targets", {}))
        targets["demo"] = {
            "base_url": self.simulator.base_url + "/",
            "rate": 500.0,
            "burst": 100,
            "max_in_flight": 64,
            "timeout_s": 10.0,
            **self.demo_table,
        }
        for name, scripted in self.scripted.items():
            targets[name] = {"base_url": self.simulators[name].base_url + "/", **scripted.table}
        fleet = dict(user.get("fleet", {}))
        fleet.setdefault("user_agent", "jetfleet-dev (+local demo on loopback)")
        tables: dict[str, dict[str, Any]] = {
            "nats": self._nats_table(),
            "redis": {"url": self.redis.url},
            # Reads stay open on this loopback-only stack so the dashboard page works
            # without a token; control calls need it (DIR/auth/gateway-token).
            "gateway": {
                "host": "127.0.0.1",
                "port": self.gateway_port,
                "token": self.gateway_token,
                "open_reads": True,
            },
            "fleet": fleet,
        }
        # Every other table of the user's file ([worker], [worker.browser], [quarantine],
        # [versions], [identities.*], ...) is kept: the stack owns only where its own
        # servers and gateway are.
        for name, body in user.items():
            if name not in tables and name != "targets" and isinstance(body, dict):
                tables[name] = dict(body)
        tables.update({f"targets.{name}": body for name, body in targets.items()})
        header = "# Written by `jetfleet dev`; regenerated on every start.\n"
        # It holds the gateway token: readable by the owner only, like the bundle's files.
        self.config_path.touch(mode=0o600)
        self.config_path.chmod(0o600)
        self.config_path.write_text(header + toml_tables(tables))

    def _nats_table(self) -> dict[str, Any]:
        table: dict[str, Any] = {
            "url": self.nats.url,
            "credentials": str(self.auth_dir),
            # The embedded server: the start-up durability check says "dev", quietly.
            "dev": True,
            "replicas": self.nats.replicas,
        }
        if isinstance(self.nats, EmbeddedCluster):
            table["monitor_url"] = ",".join(self.nats.monitor_urls)
        return table

    def _write_env(self) -> None:
        write_env(
            self.data_dir / "env",
            {
                "NATS_URL": self.nats.url,
                "REDIS_URL": self.redis.url,
                "JETFLEET_CONFIG": str(self.config_path),
                # A CLI in another shell connects as operator from this bundle.
                "JETFLEET_NATS__CREDENTIALS": str(self.auth_dir),
                "JETFLEET_GATEWAY_URL": self.gateway_url,
                "JETFLEET_TARGET_URL": self.simulator.base_url,
            },
        )

    async def _declare_topology(self, settings: Settings) -> None:
        # Every child declares it too, but the stack must not depend on which comes first:
        # a submission to a stream that does not exist yet is dropped without a word.
        nc = await connect_nats(settings.nats, "jetfleet-dev", role="admin")
        try:
            await declare(nc.jetstream(), settings)
        finally:
            await nc.close()

    def replicas(self, service: str) -> list[str]:
        """The child names of ``service``'s replicas: ``NAME``, ``NAME-2``, ..."""
        return [_replica_name(service, n) for n in range(1, self.service_replicas + 1)]

    def _spawn_service(self, service: str, replica: int) -> None:
        name = _replica_name(service, replica)
        env: dict[str, str] = {}
        if service == "gateway" and replica > 1:
            # Each gateway replica listens on a port of its own; the first one's is the
            # config's (gateway_url).
            env["JETFLEET_GATEWAY__PORT"] = str(free_port())
        self._spawn(name, ["serve", service], env)

    def _spawn(
        self,
        name: str,
        args: list[str],
        env: Mapping[str, str] | None = None,
        module: str = "jetfleet",
    ) -> None:
        logs = self.data_dir / "logs"
        logs.mkdir(exist_ok=True)
        self._launches[name] = (list(args), dict(env or {}), module)
        gateway_port = (env or {}).get("JETFLEET_GATEWAY__PORT")
        if args[:2] == ["serve", "gateway"]:
            port_text = gateway_port or str(self.gateway_port)
            self.ready_urls[name] = f"http://127.0.0.1:{port_text}/healthz"
        else:
            # Served only once the child's start() is done (serve_until_signalled), on a
            # port the child picks itself and logs: one picked here could be taken before
            # the child binds it, tens of seconds later on a busy machine (a quarantine
            # restart in the chaos soak died "address already in use").
            args = [*args, "--metrics-port", "0"]
            self.ready_urls.pop(name, None)
            log_file = logs / f"{name}.log"
            self._log_starts[name] = log_file.stat().st_size if log_file.exists() else 0
        self.children[name] = start_jetfleet(
            args,
            self.config_path,
            logs / f"{name}.log",
            {**self._trace_env(name), **(env or {})},
            module,
        )

    def _trace_env(self, name: str) -> dict[str, str]:
        """What points child ``name``'s spans at ``trace_endpoint``, named for its service."""
        if not self.trace_endpoint:
            return {}
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.trace_endpoint,
            "OTEL_SERVICE_NAME": "worker" if name.startswith("worker") else name,
        }

    async def add_worker(self, spec: WorkerSpec) -> str:
        """Start one more worker child on the running stack; returns its child name once
        it answers.

        Raises:
            StackError: it exited or did not answer.
        """
        name = f"worker-{spec.id}"
        self._spawn(name, spec.argv(), spec.env, spec.module)
        await self._wait_answering([name])
        return name

    def kill(self, name: str) -> None:
        """SIGKILL child ``name`` (a crash: no drain, no goodbye) and reap it."""
        proc = self.children[name]
        self.killed.add(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    async def start_again(self, name: str) -> None:
        """Start child ``name`` again, as it was first started (a crashed service or
        worker brought back by its supervisor), once ``kill`` has ended it; returns once
        it answers.

        Raises:
            StackError: it is still running, exited again, or did not answer.
        """
        if self.children[name].poll() is None:
            raise StackError(f"{name} is still running: kill it before starting it again")
        args, env, module = self._launches[name]
        self._spawn(name, args, env, module)
        self.killed.discard(name)
        await self._wait_answering([name])

    async def _wait_answering(self, names: list[str]) -> None:
        """Until children ``names`` answer; a StackError says how far each one got (the
        last line of its log, or none: still importing, or not yet connected)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ready_timeout_s
        try:
            while unknown := [n for n in names if not self._learn_url(n)]:
                dead = self.describe_dead_children()
                if dead:
                    raise StackError(f"jetfleet dev: a child exited while starting:\n{dead}")
                if loop.time() > deadline:
                    raise StackError(
                        f"jetfleet dev: {', '.join(sorted(unknown))} did not answer within "
                        f"{self.ready_timeout_s:g} s; see their logs in the data folder's logs/"
                    )
                await asyncio.sleep(_URL_POLL_S)
            await wait_answering(
                {n: self.ready_urls[n] for n in names},
                self.describe_dead_children,
                max(1.0, deadline - loop.time()),
            )
        except StackError as exc:
            raise StackError(f"{exc}\n{self._last_lines(names)}") from None

    def _learn_url(self, name: str) -> bool:
        """Whether child ``name``'s ready URL is known: read, for one serving metrics, from
        the line its start logs (``... metrics on http://host:port/metrics``)."""
        if name in self.ready_urls:
            return True
        log_file = self.data_dir / "logs" / f"{name}.log"
        if not log_file.exists():
            return False
        with log_file.open("rb") as f:
            f.seek(self._log_starts.get(name, 0))
            found = _METRICS_LINE.search(f.read().decode(errors="replace"))
        if found is None:
            return False
        self.ready_urls[name] = found.group(1)
        return True

    def _last_lines(self, names: list[str]) -> str:
        lines = []
        for name in names:
            log_file = self.data_dir / "logs" / f"{name}.log"
            text = log_file.read_text(errors="replace") if log_file.exists() else ""
            last = text.strip().splitlines()[-1][:300] if text.strip() else "(nothing logged)"
            lines.append(f"  {name}: {last}")
        return "\n".join(lines)

    def dead_children(self) -> list[str]:
        """Names of children that exited while the stack should be running (those
        ended by ``kill`` are not)."""
        return [
            name
            for name, proc in self.children.items()
            if proc.poll() is not None and name not in self.killed
        ]

    def describe_dead_children(self, tail_chars: int = 1500) -> str:
        """Which children died, each with the end of its log."""
        parts = []
        for name in self.dead_children():
            log_file = self.data_dir / "logs" / f"{name}.log"
            tail = log_file.read_text(errors="replace")[-tail_chars:] if log_file.exists() else ""
            parts.append(f"{name} exited (code {self.children[name].returncode}):\n{tail}")
        return "\n".join(parts)

    async def stop(self) -> None:
        """Stop workers first (they drain and report), then services, simulator, servers."""
        workers = [n for n in self.children if n.startswith("worker")]
        others = [n for n in self.children if n not in workers]
        for group in (workers, others):
            for name in group:
                if self.children[name].poll() is None:
                    self.children[name].terminate()
            for name in group:
                await asyncio.to_thread(_wait_or_kill, self.children[name])
        self.children.clear()
        self.ready_urls.clear()
        for sim in self._all_sites():
            await self._on_site_loop(sim.stop())
        if self.site_loop is not None:
            self.site_loop.close()
            self.site_loop = None  # stopped with the sites; a second stop has none to stop
        await asyncio.to_thread(self.redis.stop)
        await asyncio.to_thread(self.nats.stop)
        for leftover in ("dev.pid", "env"):
            (self.data_dir / leftover).unlink(missing_ok=True)


_METRICS_LINE = re.compile(r" metrics on (http://\S+/metrics)")
"""What ``serve_until_signalled`` logs once the child's metrics are served."""
_URL_POLL_S = 0.1


def _one_server(sync_always: bool) -> NatsFactory:
    def build(folder: Path, auth_include: Path) -> NatsServers:
        return EmbeddedNats(folder, sync_always=sync_always, auth_include=auth_include)

    return build


def _replica_name(service: str, replica: int) -> str:
    return service if replica == 1 else f"{service}-{replica}"


def _wait_or_kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_jetfleet(
    argv: Sequence[str],
    config: Path,
    log_path: Path,
    extra_env: Mapping[str, str] | None = None,
    module: str = "jetfleet",
) -> subprocess.Popen[bytes]:
    """Start ``python -m MODULE ARGV`` (``jetfleet`` by default) on ``config`` alone (the
    caller's JETFLEET_*, NATS_URL and REDIS_URL are dropped; its OTEL_* pass,
    ``extra_env`` over them), its output appended to ``log_path``; it dies with its
    parent."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("JETFLEET_") and k not in ("NATS_URL", "REDIS_URL")
    }
    env.update(extra_env or {})
    env["JETFLEET_CONFIG"] = str(config)
    with log_path.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", module, *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=die_with_parent,
        )
