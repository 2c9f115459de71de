"""The arq side of the bench: a no-op task and a worker settings class.

Run as a worker process by bench/arq_bench.py (``python bench/arq_tasks.py``), configured
by environment variables. The task itself does nothing but note ``time.monotonic()`` in
its per-job context; ``after_job_end`` (called once arq has stored the job's result)
writes the start and end times into two redis hashes and counts the job, in one
pipelined round trip. ``time.monotonic()`` is CLOCK_MONOTONIC on Linux, one clock for
every process on the machine, so the bench can compare it with its enqueue times.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, ClassVar

from arq.connections import RedisSettings
from peer_marks import DONE_KEY, END_KEY, READY_KEY, START_KEY


async def noop(ctx: dict[str, Any]) -> None:
    """The job: nothing but a timestamp kept in memory."""
    ctx["bench_started"] = time.monotonic()


async def _after_job_end(ctx: dict[str, Any]) -> None:
    ended = time.monotonic()
    job_id = ctx["job_id"]
    async with ctx["redis"].pipeline(transaction=False) as pipe:
        pipe.hset(START_KEY, job_id, repr(ctx.get("bench_started", ended)))
        pipe.hset(END_KEY, job_id, repr(ended))
        pipe.incr(DONE_KEY)
        await pipe.execute()


async def _on_startup(ctx: dict[str, Any]) -> None:
    await ctx["redis"].incr(READY_KEY)


class WorkerSettings:
    """arq worker settings; arq's defaults unless the bench sets the two knobs below."""

    functions: ClassVar[list[Any]] = [noop]
    redis_settings = RedisSettings(
        host="127.0.0.1", port=int(os.environ.get("BENCH_ARQ_REDIS_PORT", "6379"))
    )
    max_jobs = int(os.environ.get("BENCH_ARQ_MAX_JOBS", "10"))  # arq default: 10
    poll_delay = float(os.environ.get("BENCH_ARQ_POLL_DELAY", "0.5"))  # arq default: 0.5 s
    after_job_end = _after_job_end
    on_startup = _on_startup


if __name__ == "__main__":
    from arq.worker import run_worker

    # arq logs one INFO line per job start and end; jetfleet logs nothing per job, so
    # keep arq to warnings as well (errors still reach the log file the bench scans).
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_worker(WorkerSettings)  # type: ignore[arg-type]
