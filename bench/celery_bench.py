"""The second peer: Celery with a no-op task on an embedded redis-server (the broker).

One ``celery worker`` with the prefork pool and ``--concurrency W`` (W pool processes
run tasks, as W jetfleet worker processes do), Celery's defaults otherwise (no result
backend, early acks, prefetch multiplier 4; bench/celery_tasks.py), started with
``--without-mingle --without-gossip`` (cluster chatter at start-up, nothing per task).
Two modes:

    live   the worker is ready before the first enqueue (as the jetfleet and arq
           scenarios): throughput from the first enqueue to the last task end
    drain  all N are enqueued first, then the worker starts: throughput from the first
           task start to the last task end (the worker's start-up is not counted)

Latency is enqueue -> task end and enqueue -> task start (meaningless in ``drain``,
where every job waits for the worker to start). The enqueue is ``apply_async`` from
this process, one after another, in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from child_procs import spawn_logged
from peer_marks import DONE_KEY, READY_KEY, close_peer_run, peer_figures, read_marks
from stats import cpu_snapshot, usage_since

from jetfleet.dev.embedded import EmbeddedRedis

HERE = Path(__file__).resolve().parent
READY_TIMEOUT_S = 60.0
MODES = ("live", "drain")


def _spawn_worker(redis_port: int, concurrency: int, log_dir: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(
        {
            "BENCH_CELERY_REDIS_PORT": str(redis_port),
            "PYTHONPATH": os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]).rstrip(
                os.pathsep
            ),
            "PYTHONDONTWRITEBYTECODE": "1",
        }
    )
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "celery_tasks",
        "worker",
        "--pool",
        "prefork",
        "--concurrency",
        str(concurrency),
        "--loglevel",
        "WARNING",
        "--without-mingle",
        "--without-gossip",
    ]
    return spawn_logged(argv, log_dir / "celery-worker.log", env=env, cwd=log_dir)


async def _wait_ready(client: Any, proc: subprocess.Popen[bytes], log_dir: Path) -> float:
    started = time.monotonic()
    while int(await client.get(READY_KEY) or 0) < 1:
        if proc.poll() is not None:
            raise RuntimeError(f"the celery worker exited during start; see {log_dir}")
        if time.monotonic() - started > READY_TIMEOUT_S:
            raise RuntimeError(f"the celery worker was not ready after {READY_TIMEOUT_S:.0f} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - started


def _enqueue(app: Any, ids: list[str], enqueued_at: dict[str, float]) -> None:
    for job_id in ids:
        enqueued_at[job_id] = time.monotonic()  # just before this job's enqueue
        app.send_task("noop", task_id=job_id)


async def run_celery(
    jobs: int, workers: int, timeout_s: float, mode: str = "live", keep: bool = False
) -> dict[str, Any]:
    """Run one Celery scenario and return its figures (never leaves a process behind)."""
    import celery
    import redis.asyncio as aioredis

    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    folder = Path(tempfile.mkdtemp(prefix="jetfleet-bench-celery-"))
    redis = EmbeddedRedis(folder / "redis")
    proc: subprocess.Popen[bytes] | None = None
    client = None
    app = None
    result: dict[str, Any] = {
        "system": f"celery {celery.__version__}",
        "handler": "noop",
        "jobs": jobs,
        "workers": workers,
        "mode": mode,
        "pool": f"prefork, concurrency {workers}",
        "data_dir": str(folder) if keep else None,
    }
    try:
        await asyncio.to_thread(redis.start)
        client = aioredis.Redis(host="127.0.0.1", port=redis.port)
        log_dir = folder / "logs"
        log_dir.mkdir()
        os.environ["BENCH_CELERY_REDIS_PORT"] = str(redis.port)
        sys.path.insert(0, str(HERE))
        app = celery.Celery("bench", broker=f"redis://127.0.0.1:{redis.port}/0")
        ids = [uuid.uuid4().hex for _ in range(jobs)]
        enqueued_at: dict[str, float] = {}
        pids: dict[str, int | None] = {"redis-server": redis.process.pid if redis.process else None}
        cpu0 = cpu_snapshot(pids)
        if mode == "live":
            proc = _spawn_worker(redis.port, workers, log_dir)
            result["ready_s"] = await _wait_ready(client, proc, log_dir)
            pids["celery-worker (main + pool)"] = proc.pid
            cpu0 = cpu_snapshot(pids, tree=True)
        first = time.monotonic()
        await asyncio.wait_for(asyncio.to_thread(_enqueue, app, ids, enqueued_at), timeout_s)
        enqueue_done = time.monotonic()
        counted_from = None
        if mode == "drain":
            proc = _spawn_worker(redis.port, workers, log_dir)
            result["ready_s"] = await _wait_ready(client, proc, log_dir)
            pids["celery-worker (main + pool)"] = proc.pid
            # From its ready signal: its start-up is not the scenario's work.
            cpu0.update(cpu_snapshot({"celery-worker (main + pool)": proc.pid}, tree=True))
        deadline = time.monotonic() + timeout_s
        stop_reason = "all completed"
        while int(await client.get(DONE_KEY) or 0) < jobs:
            if time.monotonic() > deadline:
                stop_reason = f"timeout after {timeout_s:.0f} s"
                break
            if proc is not None and proc.poll() is not None:
                stop_reason = "the worker died"
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # a task run twice would be counted by now
        result["processes"] = usage_since(pids, cpu0, tree=True)
        marks = await read_marks(client)
        if mode == "drain":
            counted_from = min(marks[1].values()) if marks[1] else None
        result.update(
            peer_figures(ids, enqueued_at, marks, first, enqueue_done, counted_from=counted_from)
        )
        result["stop_reason"] = stop_reason
        result["dead_children"] = ["celery-worker"] if proc and proc.poll() is not None else []
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.aclose(), 10.0)
        if app is not None:
            with contextlib.suppress(Exception):
                app.close()
        await close_peer_run([proc], redis, folder, keep, result)
    return result


if __name__ == "__main__":
    import json

    out = {m: asyncio.run(run_celery(int(sys.argv[1]), 2, 120.0, m)) for m in MODES}
    print(json.dumps(out, indent=2, default=str))
