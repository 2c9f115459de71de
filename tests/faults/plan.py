"""Which job suffers which fault, and the per-process event log the faulty worker writes.

Every choice is a function of the job id (SHA-256), so a run is reproducible and the test
knows in advance which jobs are stalled and which lose their ack.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EFFECT_HANDLER = "test.effect"
"""One request to the job's URL (the side effect the target counts), then a short,
job-dependent piece of work."""
STALL_HANDLER = "test.stall"
"""On a job's first grant: the request, then its whole worker process freezes past the
TTL and ack_wait; later grants behave like ``test.effect``."""
TEST_HANDLERS = (EFFECT_HANDLER, STALL_HANDLER)


def _bucket(job_id: str, salt: str) -> int:
    digest = hashlib.sha256(f"{salt}:{job_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 1000


@dataclass(frozen=True)
class FaultPlan:
    """Per-job fault choices. The stalled and ack-dropping sets never overlap."""

    stall_per_mille: int = 0
    drop_ack_per_mille: int = 0
    stall_s: float = 0.0
    """How long a stalled attempt freezes its worker process (pick more than ack_wait_s)."""
    effect_min_s: float = 0.05
    effect_max_s: float = 0.35

    def __post_init__(self) -> None:
        assert 0 <= self.stall_per_mille + self.drop_ack_per_mille <= 1000

    def stalls(self, job_id: str) -> bool:
        """Whether the job's first attempt stalls past its lease."""
        return _bucket(job_id, "fault") < self.stall_per_mille

    def drops_ack(self, job_id: str) -> bool:
        """Whether the worker that commits the job never acks it."""
        b = _bucket(job_id, "fault")
        return self.stall_per_mille <= b < self.stall_per_mille + self.drop_ack_per_mille

    def handler_for(self, job_id: str) -> str:
        """The handler a job is submitted with."""
        return STALL_HANDLER if self.stalls(job_id) else EFFECT_HANDLER

    def effect_s(self, job_id: str) -> float:
        """How long the job's (non-stalled) work takes."""
        span = self.effect_max_s - self.effect_min_s
        return self.effect_min_s + span * _bucket(job_id, "time") / 999

    def to_argv(self) -> list[str]:
        """Command-line arguments of ``tests.faults.worker_main`` carrying this plan."""
        return [
            "--stall-per-mille",
            str(self.stall_per_mille),
            "--drop-ack-per-mille",
            str(self.drop_ack_per_mille),
            "--stall-s",
            repr(self.stall_s),
            "--effect-min-s",
            repr(self.effect_min_s),
            "--effect-max-s",
            repr(self.effect_max_s),
        ]


class EventLog:
    """Append-only JSON lines, one ``os.write`` each (O_APPEND): a line written before a
    SIGKILL is in the kernel, not in a Python buffer, so it survives the kill."""

    def __init__(self, path: Path, worker_id: str) -> None:
        self.path = path
        self.worker_id = worker_id
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, event: str, **fields: Any) -> None:
        """Record one event."""
        line = {
            "event": event,
            "worker": self.worker_id,
            "pid": os.getpid(),
            "t": time.time(),
            **fields,
        }
        os.write(self._fd, (json.dumps(line) + "\n").encode())

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_events(folder: Path) -> Iterator[dict[str, Any]]:
    """Every event of every ``events-*.jsonl`` in ``folder``; a torn last line (a write
    cut by SIGKILL) is skipped."""
    for path in sorted(folder.glob("events-*.jsonl")):
        for raw in path.read_text().splitlines():
            try:
                yield json.loads(raw)
            except json.JSONDecodeError:
                continue
