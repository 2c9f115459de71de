"""Durable records: committed results, dead letters, rejections, and outcome events."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from jetfleet.schemas.job import WorkOrder
from jetfleet.schemas.output import HandlerOutput
from jetfleet.schemas.report import AttemptRecord, Versions


class CommittedResult(msgspec.Struct, frozen=True, omit_defaults=True):
    """A committed result on ``jf.results.<target>``: the one side effect of a job."""

    job_id: str
    target: str
    url: str
    key: str
    handler: str
    worker: str
    attempt: int
    duration_s: float
    output: HandlerOutput
    versions: Versions
    identity: str = ""
    fence: int = 0


class DeadLetter(msgspec.Struct, frozen=True, omit_defaults=True):
    """A job that will not be retried, on ``jf.dlq.<target>``, with why and its history."""

    order: WorkOrder
    reason: str
    history: list[AttemptRecord]
    detail: str = ""


class Rejection(msgspec.Struct, frozen=True, omit_defaults=True):
    """A submission refused at admission, on ``jf.rejected.<target>``, kept with its bytes."""

    reason: str
    """Machine-readable code, e.g. ``invalid-json``, ``unknown-target``."""
    message: str
    """What was wrong and what to fix."""
    subject: str
    raw: bytes
    """The submitted bytes (the first ``fleet.max_job_bytes`` of them when oversized)."""
    job_id: str = ""
    submit_seq: int = 0
    """Sequence of the original in ``JF_SUBMIT``, where it is kept whole."""
    raw_size: int = 0
    raw_truncated: bool = False


OutcomeKind = Literal["ok", "retryable", "permanent", "blocked"]


class Outcome(msgspec.Struct, frozen=True, omit_defaults=True):
    """One attempt's outcome, on ``jf.outcome.<target>``, for metrics and quarantine."""

    job_id: str
    target: str
    worker: str
    attempt: int
    kind: OutcomeKind
    duration_s: float
    versions: Versions
    identity: str = ""
    reason: str = ""
    fence: int = 0
    detail: str = ""
    subnet: str = ""
    """The worker's subnet (``worker.subnet``), for egress and second-order rules."""
    called: bool = True
    """Whether a request went to the target (False: judged without one: expired,
    out of attempts, off the target, an unknown handler, robots-disallowed, a handler
    that sends nothing). An uncalled outcome says nothing of how the site answers, so
    it decides no circuit breaker's probe."""


class OutcomeBatch(msgspec.Struct, frozen=True):
    """A worker's ``ok`` outcome events of one target, on ``jf.outcome.<target>`` with
    header ``Jf-Batch`` (how many) and no ``Jf-Job``: 1 to 64 events, each as a lone
    event would be. Only ``ok`` events are batched (a failure is evidence by its own
    stream sequence), so a reader skips anything else found in one."""

    events: Annotated[list[Outcome], msgspec.Meta(min_length=1, max_length=64)]


class Duplicate(msgspec.Struct, frozen=True, omit_defaults=True):
    """A job settled by another job's commit of the same unit of work, on
    ``jf.duplicates.<target>``: it counts as committed without a second side effect."""

    job_id: str
    target: str
    key: str
    committed_by: str
    via: Literal["already-done", "suppressed"]
