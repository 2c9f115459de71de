"""Commands that run parts of the fleet: dev, demo, serve, worker."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nats.aio.client import Client as NatsClient

from jetfleet import event_loop
from jetfleet.auth.credentials import declares_topology, known_role
from jetfleet.cli.progress import print_json
from jetfleet.connection import connect_nats
from jetfleet.errors import IdentityOwned, JetfleetError
from jetfleet.services import SERVICE_NAMES
from jetfleet.settings import Settings
from jetfleet.topology import declare
from jetfleet.work_lanes import LaneMap

if TYPE_CHECKING:
    from jetfleet.dev.devstack import DevStack
    from jetfleet.service import Service
    from jetfleet.worker import Worker

log = logging.getLogger(__name__)


def register(commands: Any) -> None:
    """Add dev, demo, serve and worker to the parser."""
    dev = commands.add_parser(
        "dev",
        help="run the whole fleet locally until Ctrl-C",
        description="Start nats-server (one, or a 3-node cluster with --cluster 3), "
        "redis-server, every service, N workers and the demo target on loopback; print the "
        "URLs; write them to DIR/env for other shells.",
    )
    dev.add_argument(
        "--workers",
        type=int,
        default=2,
        help="worker processes (default 2), each running 32 jobs at once per lane unless "
        "--config's [worker] sets concurrency",
    )
    dev.add_argument(
        "--data",
        type=Path,
        default=Path(".jetfleet"),
        help="data folder (default ./.jetfleet); one stack per folder",
    )
    dev.add_argument(
        "--cluster",
        type=int,
        default=0,
        choices=[3],
        metavar="3",
        help="run NATS as a 3-node cluster on loopback (R3 streams, consumers and buckets; "
        "sync_interval: always; each node's store under DIR/nats-cluster/), as production "
        "should (docs/cluster.md); default: one node, R1",
    )
    dev.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="N",
        help="processes of every service (scheduler, leaser, ratelimit, quarantine, sink, "
        "gateway; default 1): N-1 of each may crash and the fleet goes on "
        "(docs/deploy.md); the gateways get ports of their own",
    )
    dev.add_argument("--json", action="store_true", help="print the URLs as JSON")
    dev.add_argument(
        "--jaeger",
        default="",
        metavar="URL",
        help="export every child's spans over OTLP/HTTP to URL (Jaeger all-in-one: "
        "http://127.0.0.1:4318); sets OTEL_EXPORTER_OTLP_ENDPOINT and OTEL_SERVICE_NAME "
        "per child (docs/tracing.md)",
    )
    dev.set_defaults(run=_run_dev)

    demo = commands.add_parser(
        "demo",
        help="the showcase: a local fleet meets misbehaving sites, then a report",
        description="A temporary dev stack with four targets that misbehave (slow pages, a "
        "429 storm with Retry-After, a challenge streak that retires one identity on one "
        "target, removed selectors and gone pages), five workers on two version releases "
        "(one SIGKILLed mid-job, one with its wall clock an hour ahead through libfaketime "
        "where installed), and where a Chromium is on PATH a fifth target and a sixth, "
        "browser worker for browser.page jobs; N jobs submitted, "
        "progress on a terminal, the dashboard URL, a report from the streams and the "
        "sites' own counts, everything stopped. Exit 0 only if nothing was lost and every "
        "job ended (docs/cli.md#jetfleet-demo).",
    )
    demo.add_argument(
        "--jobs",
        type=int,
        default=200,
        help="jobs to submit (default 200; at least 15, 25 with the browser part)",
    )
    demo.add_argument(
        "--timeout",
        type=float,
        default=100.0,
        help="give up waiting for the jobs after this many seconds (default 100)",
    )
    demo.add_argument("--json", action="store_true", help="print the report as one JSON object")
    demo.set_defaults(run=_run_demo)

    serve = commands.add_parser(
        "serve",
        help="run one service (any number of replicas)",
        description="Run one jetfleet service until SIGINT/SIGTERM, then drain it.",
        epilog="scheduler: admission; ratelimit: permits (Redis); leaser: leases and "
        "quarantine commands; sink: commits and dead letters; gateway: HTTP API and "
        "dashboard; quarantine: applies [[quarantine.rules]] to outcome events and sets "
        "records through the leaser (docs/quarantine.md). Redis (REDIS_URL or [redis] "
        "url): redis://host:port/db, a cluster redis+cluster://h1:p1,h2:p2 or a Sentinel "
        "master redis+sentinel://s1:p1,s2:p2/SERVICE (docs/rate-limits.md).",
    )
    serve.add_argument("name", choices=SERVICE_NAMES, help="the service to run")
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on HOST:PORT/metrics (0: any; docs/metrics.md)",
    )
    serve.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="the address --metrics-port listens on (default 127.0.0.1, loopback only; "
        "0.0.0.0 in a container so Prometheus can scrape it)",
    )
    serve.set_defaults(run=_run_serve)

    worker = commands.add_parser(
        "worker",
        help="run a worker pulling its targets' jobs",
        description="Run a worker: pull jobs of its targets, run "
        "handlers, report to the sink; drains on SIGINT/SIGTERM. Each target's robots.txt "
        "is obeyed before its jobs run (a disallowed URL is dead-lettered robots-disallowed "
        "unsent) unless targets.NAME.obey_robots = false, whose robots_off_reason is "
        "logged at start; so is a User-Agent naming no contact (docs/robots.md).",
    )
    worker.add_argument("--id", default="", help="worker id (default: host-pid)")
    worker.add_argument(
        "--identity",
        default="",
        help="identity this worker owns (claimed at start: refused while another live "
        "worker owns it; docs/identities.md)",
    )
    worker.add_argument(
        "--targets",
        default="",
        help="comma-separated targets (default: worker.targets, else all); a target beyond "
        "fleet.dedicated_targets brings its whole partition",
    )
    worker.add_argument(
        "--standby-targets",
        default="",
        help="comma-separated targets pulled only with slots lent by this worker's held "
        "lanes, none of their own (default: worker.standby_targets; needs --targets or "
        "worker.targets)",
    )
    worker.add_argument(
        "--concurrency",
        type=int,
        default=0,
        help="jobs at once per work lane: per target, or per partition for targets beyond "
        "fleet.dedicated_targets (default: worker.concurrency)",
    )
    worker.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on HOST:PORT/metrics (0: any; docs/metrics.md)",
    )
    worker.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="the address --metrics-port listens on (default 127.0.0.1, loopback only; "
        "0.0.0.0 in a container so Prometheus can scrape it)",
    )
    worker.set_defaults(run=_run_worker)


# The dev stack, the demo and the worker are imported by the commands that run them:
# they pull in Playwright, redis-py and every service, which `jetfleet status` and the
# other quick commands would otherwise load at each start (about half their start-up).


def _run_demo(args: argparse.Namespace) -> int:
    from jetfleet.cli import demo

    return demo.run(args)


def _run_dev(args: argparse.Namespace) -> int:
    if args.workers < 0:
        raise JetfleetError("--workers must be >= 0")
    if args.replicas < 1:
        raise JetfleetError(f"--replicas must be at least 1, not {args.replicas}")
    if args.jaeger and not args.jaeger.startswith(("http://", "https://")):
        raise JetfleetError(
            f"--jaeger {args.jaeger!r}: give the OTLP/HTTP base URL, such as "
            "http://127.0.0.1:4318 (Jaeger all-in-one's OTLP/HTTP port)"
        )
    return event_loop.run(_dev(args))


async def _dev(args: argparse.Namespace) -> int:
    from jetfleet.dev.devstack import DevStack
    from jetfleet.dev.embedded_cluster import EmbeddedCluster

    stack = DevStack(
        args.data,
        workers=args.workers,
        user_config=args.config,
        trace_endpoint=args.jaeger,
        cluster=args.cluster,
        service_replicas=args.replicas,
    )
    await stack.start()
    urls = {
        "nats": stack.nats.url,
        "redis": stack.redis.url,
        "gateway": stack.gateway_url,
        "dashboard": stack.gateway_url + "/",
        "target": stack.simulator.base_url,
        "env_file": str(stack.data_dir / "env"),
        "config": str(stack.config_path),
    }
    if isinstance(stack.nats, EmbeddedCluster):
        urls["nats_monitor"] = ",".join(stack.nats.monitor_urls)
    if args.replicas > 1:
        urls["gateways"] = ",".join(
            stack.ready_urls[name].removesuffix("/healthz") for name in stack.replicas("gateway")
        )
    if args.jaeger:
        urls["traces"] = args.jaeger
    if args.json:
        print_json(urls)
    else:
        for name, url in urls.items():
            print(f"{name:>10}: {url}")
        print(
            f"\nIn another shell here: jetfleet submit demo /page/1   (or: set -a; . "
            f"{stack.data_dir}/env)\nCtrl-C stops everything.",
            flush=True,
        )
    try:
        await _wait_for_signal(stack)
    finally:
        await stack.stop()
    return 0


async def _wait_for_signal(stack: DevStack) -> None:
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    reported: set[str] = set()
    while not stop.is_set():
        for name in set(stack.dead_children()) - reported:
            print(f"jetfleet dev: {name} exited; see {stack.data_dir}/logs/{name}.log", flush=True)
            reported.add(name)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


def _run_serve(args: argparse.Namespace) -> int:
    from jetfleet import tracing
    from jetfleet.cli.main import settings_from

    role = known_role(args.name)
    settings = settings_from(args, role)
    with tracing.traced_process(args.name, os.environ):
        return event_loop.run(
            _serve(args.name, settings, args.metrics_port, args.metrics_host),
            settings.process.event_loop,
        )


async def _serve(
    name: str, settings: Settings, metrics_port: int | None, metrics_host: str = "127.0.0.1"
) -> int:
    from jetfleet.service import serve_until_signalled

    nc = await connect_nats(settings.nats, f"jetfleet-{name}", role=known_role(name))
    await _say_durability(name, settings)
    try:
        if declares_topology(settings):
            await declare(nc.jetstream(), settings)
        service = _make_service(name, settings, nc)
        await serve_until_signalled(service, metrics_port=metrics_port, metrics_host=metrics_host)
    finally:
        await nc.close()
    return 0


async def _say_durability(name: str, settings: Settings) -> None:
    """One line at start when NATS is below what docs/cluster.md recommends for
    production (R3, ``sync_interval: always``): a warning, or under ``jetfleet dev`` an
    info line saying so. Never stops the service."""
    from jetfleet import durability

    findings, sync_checked = await durability.start_findings(settings)
    line = durability.start_line(findings, sync_checked, dev=settings.nats.dev)
    if line:
        log.log(logging.INFO if settings.nats.dev else logging.WARNING, "%s: %s", name, line)


def _make_service(name: str, settings: Settings, nc: NatsClient) -> Service:
    if name == "scheduler":
        from jetfleet.services.scheduler import Scheduler

        return Scheduler(settings, nc)
    if name == "ratelimit":
        from jetfleet.services.ratelimit import RateLimiter

        return RateLimiter(settings, nc)
    if name == "leaser":
        from jetfleet.services.leaser import Leaser

        return Leaser(settings, nc)
    if name == "sink":
        from jetfleet.services.sink import Sink

        return Sink(settings, nc)
    if name == "gateway":
        from jetfleet.services.gateway import Gateway

        return Gateway(settings, nc)
    if name == "quarantine":
        from jetfleet.services.quarantine import QuarantineService

        return QuarantineService(settings, nc)
    raise JetfleetError(f"unknown service {name!r}; choose one of {', '.join(SERVICE_NAMES)}")


class _WorkerService:
    name = "worker"

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.metrics = worker.metrics

    async def start(self) -> None:
        await self.worker.start()

    async def drain(self, timeout_s: float = 30.0) -> None:
        await self.worker.drain(timeout_s)


def _run_worker(args: argparse.Namespace) -> int:
    from jetfleet.cli.main import settings_from

    settings = settings_from(args, "worker")
    targets = [t for t in args.targets.split(",") if t] or list(settings.worker.targets)
    for target in targets:
        settings.target(target)  # unknown target: a clear error before connecting
    standby = [t for t in args.standby_targets.split(",") if t]
    for target in standby:
        settings.target(target)
    if args.concurrency or standby:
        import msgspec

        worker_settings = msgspec.structs.replace(
            settings.worker,
            concurrency=args.concurrency or settings.worker.concurrency,
            standby_targets=tuple(standby) or settings.worker.standby_targets,
        )
        settings = msgspec.structs.replace(settings, worker=worker_settings)
    from jetfleet.worker.slot_lending import standby_lanes

    lanes = LaneMap(settings)  # a standby target it serves anyway: an error before connecting
    served = lanes.lanes_for(targets or list(settings.targets))
    standby_lanes(lanes, served, settings.worker.standby_targets, every=not targets)
    if settings.worker.browser.enabled:
        from jetfleet.version_tuple import browser_version

        browser_version(settings)  # no Chromium: a clear error before connecting
    worker_id = args.id or settings.worker.id or f"{socket.gethostname()}-{os.getpid()}"
    identity = args.identity or settings.worker.identity
    from jetfleet import tracing

    described = {tracing.WORKER_ID: worker_id, tracing.IDENTITY: identity}
    with tracing.traced_process("worker", os.environ, described):
        return event_loop.run(
            _worker(settings, worker_id, identity, targets, args.metrics_port, args.metrics_host),
            settings.process.event_loop,
        )


async def _worker(
    settings: Settings,
    worker_id: str,
    identity: str,
    targets: list[str],
    metrics_port: int | None,
    metrics_host: str = "127.0.0.1",
) -> int:
    from jetfleet.service import serve_until_signalled
    from jetfleet.worker import Worker

    nc = await connect_nats(settings.nats, f"jetfleet-worker-{worker_id}", role="worker")
    try:
        if declares_topology(settings):
            await declare(nc.jetstream(), settings)
        worker = Worker(settings, nc, worker_id, targets, identity=identity)
        await serve_until_signalled(
            _WorkerService(worker),
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            stop=worker.quit,
        )
    finally:
        await nc.close()
    if worker.claim is not None and worker.claim.lost.is_set():
        raise IdentityOwned(
            f"worker {worker_id} stopped: it no longer owns identity {identity!r} (another "
            "worker holds it, or its claim lapsed or could not be renewed; started again, it "
            "claims it afresh and reads its state from its state_dir)"
        )
    return 0


def temp_stack_dir() -> Path:
    """A fresh temporary folder for a throwaway stack."""
    return Path(tempfile.mkdtemp(prefix="jetfleet-"))
