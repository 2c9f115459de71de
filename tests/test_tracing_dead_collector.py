"""A collector that takes connections and never answers costs nothing but dropped spans:
a dev stack (every service and a worker as child processes) and `jetfleet submit` all
exporting to it still commit every job, and every process still stops gracefully (drain,
then exit 0) rather than being killed at the stack's stop timeout."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from pathlib import Path

import pytest

from jetfleet.dev.devstack import DevStack
from jetfleet.dev.stack_env import read_env
from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(240)

JOBS = 3


async def cli(stack: DevStack, *args: str) -> str:
    """``jetfleet ARGS`` from another process, with the stack's env (and OTEL_*)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETFLEET_")}
    env.update(read_env(stack.data_dir / "env"))
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = stack.trace_endpoint
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "jetfleet", *args),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def test_a_collector_that_never_answers_loses_no_job_and_holds_no_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)  # connections queue in the kernel; nothing ever answers
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "3")
        for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME"):
            monkeypatch.delenv(name, raising=False)
        endpoint = f"http://127.0.0.1:{hung.getsockname()[1]}"
        stack = DevStack(tmp_path, workers=1, trace_endpoint=endpoint)
        await stack.start()
        children = dict(stack.children)
        try:
            paths = [f"/page/{n}" for n in range(1, JOBS + 1)]
            await cli(stack, "submit", "demo", *paths, "--json")

            async def committed() -> bool:
                status = json.loads(await cli(stack, "status", "--json"))
                return bool(status["totals"]["committed"] == JOBS)

            await wait_for(committed, 90, f"{JOBS} commits with the collector hung")
        finally:
            await stack.stop()
    assert {name: child.returncode for name, child in children.items()} == {
        name: 0 for name in children
    }, "a process was killed at the stop timeout, or failed"
