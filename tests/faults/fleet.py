"""Faulty worker processes for a test: start, SIGKILL, replace, stop (no orphans).

Each worker is ``python -m tests.faults.worker_main`` in the project root, with
``JETFLEET_CONFIG`` set to the test's config file and its own event log and stderr log.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jetfleet.dev.embedded import die_with_parent
from tests.conftest import wait_for
from tests.faults.plan import FaultPlan, read_events

PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Kill:
    """One SIGKILL: whom, and which of its jobs were mid-flight at that moment."""

    worker: str
    pid: int
    in_flight: list[str] = field(default_factory=list)


class WorkerFleet:
    """The faulty worker processes of one test, all under ``folder``."""

    def __init__(self, folder: Path, config_path: Path, plan: FaultPlan) -> None:
        self.folder = folder
        self.config_path = config_path
        self.plan = plan
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.kills: list[Kill] = []
        self.exit_codes: dict[str, int] = {}
        self.forced: list[str] = []
        """Workers that did not exit within the stop timeout and had to be killed."""
        self._next = 0
        folder.mkdir(parents=True, exist_ok=True)

    def events_path(self, worker_id: str) -> Path:
        """The worker's event log."""
        return self.folder / f"events-{worker_id}.jsonl"

    def events(self) -> list[dict[str, Any]]:
        """Every event every worker of this fleet wrote so far."""
        return list(read_events(self.folder))

    def spawn(self) -> str:
        """Start one more worker with a new id; returns the id."""
        worker_id = f"w-{self._next}"
        self._next += 1
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("JETFLEET_") and k not in ("NATS_URL", "REDIS_URL")
        }
        env["JETFLEET_CONFIG"] = str(self.config_path)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p
        )
        argv = [
            sys.executable,
            "-m",
            "tests.faults.worker_main",
            "--id",
            worker_id,
            "--events",
            str(self.events_path(worker_id)),
            *self.plan.to_argv(),
        ]
        with (self.folder / f"{worker_id}.log").open("ab") as out:
            self.procs[worker_id] = subprocess.Popen(
                argv,
                cwd=PROJECT_ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )
        return worker_id

    def live(self) -> list[str]:
        """Ids of workers still running."""
        return [w for w, p in self.procs.items() if p.poll() is None]

    def dead_unexpectedly(self) -> list[str]:
        """Workers that exited although nobody killed or stopped them."""
        killed = {k.worker for k in self.kills}
        return [
            w
            for w, p in self.procs.items()
            if p.poll() is not None and w not in killed and w not in self.exit_codes
        ]

    def ready(self) -> list[str]:
        """Live workers that have started pulling (and will drain on SIGTERM)."""
        ready = {e["worker"] for e in self.events() if e["event"] == "ready"}
        return [w for w in self.live() if w in ready]

    def in_flight(self) -> dict[str, list[str]]:
        """Per worker, the jobs whose handler it started and has not finished (its log)."""
        open_: dict[str, dict[tuple[str, int], None]] = {}
        for e in self.events():
            jobs = open_.setdefault(e["worker"], {})
            if e["event"] == "start":
                jobs[(e["job"], e["attempt"])] = None
            elif e["event"] == "outcome":
                jobs.pop((e["job"], e["attempt"]), None)
        return {w: sorted(job for job, _ in jobs) for w, jobs in open_.items()}

    async def kill(self, worker_id: str) -> Kill:
        """SIGKILL the worker process (no drain, no cleanup) and reap it."""
        proc = self.procs[worker_id]
        in_flight = self.in_flight().get(worker_id, [])
        os.kill(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(proc.wait)
        kill = Kill(worker_id, proc.pid, in_flight)
        self.kills.append(kill)
        return kill

    async def kill_on_progress(
        self,
        progress: Callable[[], Awaitable[int]],
        thresholds: list[int],
        seed: int,
        timeout_s: float = 120.0,
    ) -> None:
        """Kill a random ready worker that has jobs in flight each time ``progress``
        reaches the next threshold, and start a replacement at once."""
        rng = random.Random(seed)
        victims: list[str] = []

        async def busy_victims() -> bool:
            busy = self.in_flight()
            victims[:] = [w for w in self.ready() if busy.get(w)]
            return bool(victims)

        for threshold in thresholds:

            async def reached(threshold: int = threshold) -> bool:
                return await progress() >= threshold

            await wait_for(reached, timeout_s, f"progress {threshold} before a kill")
            await wait_for(busy_victims, timeout_s, "a worker with jobs in flight")
            await self.kill(rng.choice(sorted(victims)))
            self.spawn()

    async def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM every live worker (they drain), wait, SIGKILL any left after
        ``timeout_s`` (noted in ``forced``). Safe to call more than once."""
        live = {w: p for w, p in self.procs.items() if p.poll() is None}
        for proc in live.values():
            proc.terminate()
        deadline = asyncio.get_running_loop().time() + timeout_s
        for worker_id, proc in live.items():
            left = max(0.1, deadline - asyncio.get_running_loop().time())
            try:
                await asyncio.to_thread(proc.wait, left)
            except subprocess.TimeoutExpired:
                self.forced.append(worker_id)
                proc.kill()
                await asyncio.to_thread(proc.wait)
            self.exit_codes[worker_id] = proc.returncode

    def log_tail(self, worker_id: str, chars: int = 2000) -> str:
        """The end of a worker's stderr log."""
        path = self.folder / f"{worker_id}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""
