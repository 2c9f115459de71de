"""A jetfleet service (``jetfleet serve NAME``) as a process a test can stall and resume.

SIGSTOP freezes it with its NATS connection open: the server keeps routing requests to
it, so callers time out rather than hear "no responders", and what they sent piles up
in its socket until SIGCONT (the stalled-but-alive service of issue 8, item 7).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

from jetfleet.dev.embedded import die_with_parent
from tests.conftest import wait_for
from tests.faults.fleet import PROJECT_ROOT


class ServiceProcess:
    """One service replica run by ``python -m jetfleet serve``, logging to ``folder``."""

    def __init__(self, name: str, folder: Path, config_path: Path) -> None:
        self.name = name
        self.log_path = folder / f"{name}.log"
        self.config_path = config_path
        self.proc: subprocess.Popen[bytes] | None = None
        folder.mkdir(parents=True, exist_ok=True)

    async def start(self, timeout_s: float = 30.0) -> None:
        """Start it and wait until it says it answers."""
        self._launch()

        async def started() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log_tail()
            return f"{self.name} started" in self.log_path.read_text(errors="replace")

        await wait_for(started, timeout_s, f"{self.name} to start")

    def _launch(self) -> None:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("JETFLEET_") and k not in ("NATS_URL", "REDIS_URL")
        }
        env["JETFLEET_CONFIG"] = str(self.config_path)
        argv = [
            sys.executable,
            "-m",
            "jetfleet",
            "--config",
            str(self.config_path),
            "--stack",
            str(self.log_path.parent / "no-dev-stack"),
            "serve",
            self.name,
        ]
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                argv,
                cwd=PROJECT_ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )

    def _signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None and self.proc.poll() is None, self.log_tail()
        os.kill(self.proc.pid, sig)

    def pause(self) -> None:
        """SIGSTOP: frozen mid-whatever, connection still open."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT: it carries on with what piled up meanwhile."""
        self._signal(signal.SIGCONT)

    async def stop(self, timeout_s: float = 20.0) -> int:
        """Resume if paused, SIGTERM (it drains), SIGKILL after ``timeout_s``; the exit
        code. Safe to call more than once."""
        proc = self.proc
        if proc is None:
            return 0
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
            try:
                await asyncio.to_thread(proc.wait, timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)
        return proc.returncode

    def log_tail(self, chars: int = 3000) -> str:
        """The end of its log."""
        path = self.log_path
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""
