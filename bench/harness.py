"""Shared plumbing for the standalone benchmarks (lease, dlq, targets, queue memory).

An embedded nats-server in a temp folder, a ``jetfleet.toml`` for it, jetfleet services
either in this process or as ``python -m jetfleet serve NAME`` children, timed calls with
N callers in flight, and a cleanup that always stops what was started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from child_procs import wait_or_kill
from stats import latency_summary

from jetfleet.dev.devstack import start_jetfleet
from jetfleet.dev.embedded import EmbeddedNats, EmbeddedRedis
from jetfleet.dev.settings_file import toml_tables
from jetfleet.settings import Settings, load_settings

READY_TIMEOUT_S = 60.0
_READY = re.compile(r"jetfleet\.service: \S+ started")


NO_REDIS_URL = "redis://127.0.0.1:1/0"
"""Where a config without a redis-server points: nothing listens on port 1, so a service
that reaches for Redis fails loudly instead of using the machine's own Redis on the
standard port (the settings' default URL)."""


def write_config(
    folder: Path, nats_url: str, tables: dict[str, dict[str, Any]], redis_url: str = NO_REDIS_URL
) -> Path:
    """Write ``folder/jetfleet.toml`` for ``nats_url`` and ``redis_url`` plus ``tables``
    and return its path.

    ``tables`` maps a table name (``fleet``, ``targets.demo``) to its keys. The leaser
    keeps every target's in-flight places in Redis: a bench that runs one starts an
    embedded redis-server (``start_redis``) and passes its URL.
    """
    body: dict[str, dict[str, Any]] = {"nats": {"url": nats_url}, "redis": {"url": redis_url}}
    body.update(tables)
    path = folder / "jetfleet.toml"
    path.write_text(toml_tables(body))
    return path


def load(path: Path) -> Settings:
    """The settings in ``path`` (the environment is ignored, as DevStack does)."""
    return load_settings(path, {})


class Children:
    """jetfleet services started as child processes, each with its own log file."""

    def __init__(self, folder: Path, config: Path) -> None:
        self.folder = folder
        self.config = config
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        (folder / "logs").mkdir(parents=True, exist_ok=True)

    def spawn(self, name: str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        """Start ``python -m jetfleet ARGV`` as child ``name``."""
        proc = start_jetfleet(argv, self.config, self.folder / "logs" / f"{name}.log")
        self.procs[name] = proc
        return proc

    def log_path(self, name: str) -> Path:
        return self.folder / "logs" / f"{name}.log"

    async def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Wait until every child logged ``<service> started`` (bounded)."""
        deadline = time.monotonic() + timeout_s
        while True:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                tails = "\n".join(
                    f"{n}: {self.log_path(n).read_text(errors='replace')[-1500:]}" for n in dead
                )
                raise RuntimeError(f"child(ren) exited during start:\n{tails}")
            waiting = [
                n
                for n in self.procs
                if not _READY.search(
                    self.log_path(n).read_text(errors="replace")
                    if self.log_path(n).exists()
                    else ""
                )
            ]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {timeout_s:.0f} s: {', '.join(waiting)}")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        """SIGTERM every child, SIGKILL after the timeout."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            await asyncio.to_thread(wait_or_kill, proc)

    def logs(self) -> list[Path]:
        return sorted((self.folder / "logs").glob("*.log"))


async def start_nats(folder: Path) -> EmbeddedNats:
    """An embedded nats-server (JetStream, file storage) under ``folder/nats``."""
    nats = EmbeddedNats(folder / "nats")
    await asyncio.to_thread(nats.start)
    return nats


async def start_redis(folder: Path) -> EmbeddedRedis:
    """An embedded redis-server (no persistence) under ``folder/redis``."""
    redis = EmbeddedRedis(folder / "redis")
    await asyncio.to_thread(redis.start)
    return redis


async def timed_calls(
    calls: Sequence[Callable[[], Awaitable[Any]]], concurrency: int, timeout_s: float
) -> tuple[list[float], list[Any], float]:
    """Run ``calls`` with ``concurrency`` callers in flight; each call's latency (s), its
    result (in order) and the wall time of the whole batch."""
    latencies = [0.0] * len(calls)
    results: list[Any] = [None] * len(calls)
    todo = iter(range(len(calls)))

    async def lane() -> None:
        for i in todo:
            t0 = time.perf_counter()
            results[i] = await calls[i]()
            latencies[i] = time.perf_counter() - t0

    started = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(lane() for _ in range(max(1, concurrency)))), timeout_s)
    return latencies, results, time.perf_counter() - started


def summary(latencies: Sequence[float], wall_s: float) -> dict[str, Any]:
    """p50/p90/p99/max in ms, and calls per second over the batch."""
    out: dict[str, Any] = dict(latency_summary(latencies))
    out["per_s"] = len(latencies) / wall_s if wall_s > 0 else 0.0
    out["wall_s"] = wall_s
    return out


class ProblemCounter(logging.Handler):
    """Counts log records at WARNING or above from in-process services (and keeps a few)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.count = 0
        self.first: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        if len(self.first) < 5:
            self.first.append(self.format(record)[:300])


@contextlib.contextmanager
def counting_problems() -> Any:
    """Count WARNING+ log records in this process for the duration of the block."""
    counter = ProblemCounter()
    root = logging.getLogger()
    root.addHandler(counter)
    try:
        yield counter
    finally:
        root.removeHandler(counter)


async def wait_until_done(
    stack: Any, done: Callable[[], bool], deadline: float, done_reason: str
) -> str:
    """Poll ``done`` (the bench's own counters) until it holds, a child of ``stack`` dies
    or the monotonic ``deadline`` passes; returns why it stopped waiting."""
    while not done():
        if time.monotonic() > deadline:
            return "timeout"
        if stack.dead_children():
            return "a child died"
        await asyncio.sleep(0.05)
    return done_reason


async def close_case(
    nc: Any,
    children: Children | None,
    servers: Sequence[Any],
    folder: Path,
    keep: bool,
    result: dict[str, Any],
    problems: ProblemCounter,
) -> None:
    """End a case on bare servers: close the bench's connection, stop the children and
    then the servers (embedded nats-server or redis-server; None for one that never
    started), scan every log into ``result["log_problems"]``, add the in-process
    warnings, and remove ``folder`` unless ``keep``."""
    from stats import scan_logs

    if nc is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 10.0)
    if children is not None:
        await children.stop()
    started = [s for s in servers if s is not None]
    for server in started:
        await asyncio.to_thread(server.stop)
    logs = children.logs() if children is not None else []
    result["log_problems"] = scan_logs([*logs, *(s.log_path for s in started)])
    result["inproc_log_problems"] = {"count": problems.count, "first": problems.first}
    if keep:
        result["data_dir"] = str(folder)
    else:
        shutil.rmtree(folder, ignore_errors=True)


def fmt_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table (numbers right-aligned, one decimal)."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
        return str(v)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(str(r[i])) for r in [list(header), *cells]) for i in range(len(header))]
    lines = [
        "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)),
        "  ".join("-" * w for w in widths),
    ]
    for row in cells:
        lines.append(
            "  ".join(
                [row[0].ljust(widths[0])]
                + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
            )
        )
    return "\n".join(lines)


def tree_lines(before: dict[str, Any], after: dict[str, Any]) -> str:
    """A line saying which code the run saw, and a warning if it changed meanwhile."""
    line = f"tree {before['sha256']} (newest {before['newest']} {before['newest_mtime_utc']} UTC)"
    if after["sha256"] != before["sha256"]:
        line += (
            f"\nWARNING: the product code changed during this run: now {after['sha256']} "
            f"(newest {after['newest']} {after['newest_mtime_utc']} UTC)"
        )
    return line


def run_with_tree(main: Callable[[], int]) -> int:
    """Run a bench's ``main`` and say which product code it measured (and whether that
    code changed during the run)."""
    from tree_state import tree_state

    before = tree_state()
    code = main()
    print(tree_lines(before, tree_state()))
    return code


async def stop_stack(
    stack: Any,
    nc: Any,
    folder: Path,
    keep: bool,
    result: dict[str, Any],
    extra_logs: Sequence[Path] = (),
) -> None:
    """Close the bench's connection, stop a DevStack, scan every log for problems into
    ``result["log_problems"]`` and remove ``folder`` unless ``keep``."""
    from stats import scan_logs

    if nc is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 10.0)
    logs = [*sorted((stack.data_dir / "logs").glob("*.log")), stack.nats.log_path, *extra_logs]
    try:
        await stack.stop()
    finally:
        result["log_problems"] = scan_logs(logs)
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
