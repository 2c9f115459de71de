"""Plain child processes of a bench (peer workers, floor consumers): start one with its
output in a log file, stop a group of them however they behave."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from jetfleet.dev.embedded import die_with_parent

STOP_TIMEOUT_S = 15.0


def spawn_logged(
    argv: Sequence[str],
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` with stdout and stderr appended to ``log_path``; the child dies with
    this process (a bench stopped by Ctrl-C or a crash leaves nothing running)."""
    with log_path.open("ab") as out:
        return subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None,
            cwd=str(cwd) if cwd is not None else None,
            preexec_fn=die_with_parent,
        )


def stop_all(procs: Iterable[subprocess.Popen[bytes] | None]) -> None:
    """SIGTERM every child still running, then wait for each; SIGKILL after the timeout."""
    running = [p for p in procs if p is not None]
    for proc in running:
        if proc.poll() is None:
            proc.terminate()
    for proc in running:
        wait_or_kill(proc)


def wait_or_kill(proc: subprocess.Popen[bytes]) -> None:
    """Wait for a child told to stop; SIGKILL it after the timeout."""
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
