"""The figures of a peer queue (arq, Celery) from the marks its worker wrote in Redis.

Both peers' tasks write ``bench:start`` and ``bench:end`` (job id -> monotonic time)
and count ``bench:done`` (bench/arq_tasks.py, bench/celery_tasks.py); the bench knows
when it enqueued each job. This turns those into the same figures jetfleet's scenarios
report.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from child_procs import stop_all
from stats import latency_summary, scan_logs

START_KEY = "bench:start"
END_KEY = "bench:end"
DONE_KEY = "bench:done"
READY_KEY = "bench:ready"


async def read_marks(client: Any) -> tuple[int, dict[str, float], dict[str, float]]:
    """Runs counted, start times and end times, from an asyncio Redis client."""
    done = int(await client.get(DONE_KEY) or 0)
    starts = {_text(k): float(v) for k, v in (await client.hgetall(START_KEY)).items()}
    ends = {_text(k): float(v) for k, v in (await client.hgetall(END_KEY)).items()}
    return done, starts, ends


def _text(key: bytes | str) -> str:
    return key.decode() if isinstance(key, bytes) else key


def peer_figures(
    ids: Sequence[str],
    enqueued_at: Mapping[str, float],
    marks: tuple[int, dict[str, float], dict[str, float]],
    first: float,
    enqueue_done: float,
    refused: int = 0,
    counted_from: float | None = None,
    label: str = "enqueue -> task end",
) -> dict[str, Any]:
    """Throughput from ``counted_from`` (default: the first enqueue) to the last end;
    latency enqueue -> end and enqueue -> start."""
    done, starts, ends = marks
    completed = [j for j in ids if j in ends]
    last = max(ends.values()) if ends else time.monotonic()
    elapsed = last - (first if counted_from is None else counted_from)
    return {
        "committed": len(completed),
        "dead": 0,
        "rejected": refused,
        "lost": len(ids) - len(completed) - refused,
        "runs_counted": done,
        "duplicates": max(0, done - len(completed)),
        "submit_s": enqueue_done - first,
        "elapsed_s": elapsed,
        "jobs_per_s": len(completed) / elapsed if elapsed > 0 else 0.0,
        "latency": latency_summary(ends[j] - enqueued_at[j] for j in completed),
        "latency_label": label,
        "latency_to_start": latency_summary(
            starts[j] - enqueued_at[j] for j in completed if j in starts
        ),
    }


async def close_peer_run(
    procs: Sequence[subprocess.Popen[bytes] | None],
    redis: Any,
    folder: Path,
    keep: bool,
    result: dict[str, Any],
) -> None:
    """Stop the peer's workers and its redis-server, scan their logs for problems into
    ``result["log_problems"]``, and remove ``folder`` unless ``keep``."""
    await asyncio.to_thread(stop_all, procs)
    await asyncio.to_thread(redis.stop)
    result["log_problems"] = scan_logs([*sorted((folder / "logs").glob("*.log")), redis.log_path])
    if not keep:
        shutil.rmtree(folder, ignore_errors=True)
