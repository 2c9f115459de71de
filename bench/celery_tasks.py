"""The Celery side of the bench: a no-op task, its app, and the timestamps the bench reads.

Run as a worker by bench/celery_bench.py (``python -m celery -A celery_tasks worker ...``
with bench/ on ``PYTHONPATH``), configured by the environment variable
``BENCH_CELERY_REDIS_PORT``. The app is Celery's defaults but for the broker: Redis on
that port, no result backend (Celery's default: results are not stored), early acks
(default), prefetch multiplier 4 (default). The task does nothing; ``task_prerun`` and
``task_postrun`` note ``time.monotonic()`` and the post-run handler writes the start and
end times into two Redis hashes and counts the task, in one pipelined round trip (as
bench/arq_tasks.py does for arq). ``time.monotonic()`` is CLOCK_MONOTONIC on Linux, one
clock for every process on the machine.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery
from celery.signals import task_postrun, task_prerun, worker_ready
from peer_marks import DONE_KEY, END_KEY, READY_KEY, START_KEY

PORT = int(os.environ.get("BENCH_CELERY_REDIS_PORT", "6379"))
BROKER = f"redis://127.0.0.1:{PORT}/0"

app = Celery("bench", broker=BROKER)
app.conf.broker_connection_retry_on_startup = True  # silences a start-up warning only

_started: dict[str, float] = {}
_client: list[redis.Redis] = []


def _redis() -> redis.Redis:
    """One client per pool process (made after the fork)."""
    if not _client:
        _client.append(redis.Redis(host="127.0.0.1", port=PORT))
    return _client[0]


@app.task(name="noop")
def noop() -> None:
    """The job: nothing."""


@task_prerun.connect
def _on_prerun(task_id: str = "", **_: Any) -> None:
    _started[task_id] = time.monotonic()


@task_postrun.connect
def _on_postrun(task_id: str = "", **_: Any) -> None:
    ended = time.monotonic()
    pipe = _redis().pipeline(transaction=False)
    pipe.hset(START_KEY, task_id, repr(_started.pop(task_id, ended)))
    pipe.hset(END_KEY, task_id, repr(ended))
    pipe.incr(DONE_KEY)
    pipe.execute()


@worker_ready.connect
def _on_ready(**_: Any) -> None:
    _redis().incr(READY_KEY)
