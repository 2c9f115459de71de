"""The peer: arq with a no-op task on an embedded redis-server, W worker processes.

Throughput is counted from the first enqueue to the last job whose result arq stored
(``after_job_end``); latency is enqueue -> result stored, and enqueue -> task start.
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
IN_FLIGHT = 256  # enqueues awaiting redis at once (the same as the jetfleet submitter)
READY_TIMEOUT_S = 60.0


def _spawn_worker(
    n: int, redis_port: int, max_jobs: int, poll_delay: float, log_dir: Path
) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(
        {
            "BENCH_ARQ_REDIS_PORT": str(redis_port),
            "BENCH_ARQ_MAX_JOBS": str(max_jobs),
            "BENCH_ARQ_POLL_DELAY": repr(poll_delay),
            "PYTHONDONTWRITEBYTECODE": "1",
        }
    )
    argv = [sys.executable, str(HERE / "arq_tasks.py")]
    return spawn_logged(argv, log_dir / f"arq-worker-{n}.log", env=env, cwd=log_dir)


async def run_arq(
    jobs: int,
    workers: int,
    timeout_s: float,
    max_jobs: int = 10,
    poll_delay: float = 0.5,
    keep: bool = False,
) -> dict[str, Any]:
    """Run the arq scenario and return its figures (never leaves a process behind)."""
    import arq
    from arq import create_pool
    from arq.connections import RedisSettings

    folder = Path(tempfile.mkdtemp(prefix="jetfleet-bench-arq-"))
    redis = EmbeddedRedis(folder / "redis")
    procs: list[subprocess.Popen[bytes]] = []
    pool = None
    result: dict[str, Any] = {
        "system": f"arq {arq.VERSION}",
        "handler": "noop",
        "jobs": jobs,
        "workers": workers,
        "max_jobs": max_jobs,
        "poll_delay_s": poll_delay,
        "data_dir": str(folder) if keep else None,
    }
    try:
        await asyncio.to_thread(redis.start)
        pool = await create_pool(
            RedisSettings(host="127.0.0.1", port=redis.port), default_queue_name="arq:queue"
        )
        log_dir = folder / "logs"
        log_dir.mkdir()
        started = time.monotonic()
        procs = [
            _spawn_worker(n, redis.port, max_jobs, poll_delay, log_dir) for n in range(workers)
        ]
        while int(await pool.get(READY_KEY) or 0) < workers:
            dead = [p.pid for p in procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"arq worker(s) {dead} exited during start; see {log_dir}")
            if time.monotonic() - started > READY_TIMEOUT_S:
                raise RuntimeError(f"arq workers not ready after {READY_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.05)
        result["ready_s"] = time.monotonic() - started

        ids = [uuid.uuid4().hex for _ in range(jobs)]
        enqueued_at: dict[str, float] = {}
        gate = asyncio.Semaphore(IN_FLIGHT)
        refused = 0

        async def enqueue_one(job_id: str) -> None:
            nonlocal refused
            async with gate:
                enqueued_at[job_id] = time.monotonic()  # just before this job's enqueue
                if await pool.enqueue_job("noop", _job_id=job_id) is None:
                    refused += 1  # arq refuses a job id it already knows

        pids: dict[str, int | None] = {f"arq-worker-{n}": p.pid for n, p in enumerate(procs)}
        pids["redis-server"] = redis.process.pid if redis.process else None
        cpu0 = cpu_snapshot(pids)
        first = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(enqueue_one(j) for j in ids)), timeout_s)
        enqueue_done = time.monotonic()

        deadline = first + timeout_s
        stop_reason = "all completed"
        while True:
            done = int(await pool.get(DONE_KEY) or 0)
            if done >= jobs:
                break
            if time.monotonic() > deadline:
                stop_reason = f"timeout after {timeout_s:.0f} s"
                break
            if any(p.poll() is not None for p in procs):
                stop_reason = "a worker died"
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # a job run twice would be counted by now

        marks = await read_marks(pool)
        result["processes"] = usage_since(pids, cpu0)
        figures = peer_figures(
            ids, enqueued_at, marks, first, enqueue_done, refused, label="enqueue -> result stored"
        )
        result.update(figures)
        result["stop_reason"] = stop_reason
        result["queued_at_end"] = await pool.zcard("arq:queue")
        result["dead_children"] = [
            f"arq-worker-{n}" for n, p in enumerate(procs) if p.poll() is not None
        ]
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if pool is not None:
            with contextlib.suppress(Exception):  # best effort; the server is stopped next
                await asyncio.wait_for(pool.aclose(), 10.0)
        await close_peer_run(procs, redis, folder, keep, result)
    return result
