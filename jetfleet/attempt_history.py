"""A job's attempt history: kept in its ledger entry, merged into its dead letter.

Every attempt that ends in a release of its lease (a failure to retry, a block, a lost
lease, a report the sink did not settle) is recorded by the leaser in the job's
``jf-fences`` entry (``JobLeaseHistory.attempts``, ``with_attempt``), from the record the
worker's release carries. The attempt that ends the job is the worker's own record in
its report. A dead letter's history is both, and, for jobs that ran before outcome events
moved to per-target subjects, the events still stored on the job's old per-job outcome
subject (``old_attempts``; read until ``fleet.retention_s`` after the switch).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import msgspec
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.direct_batch import read_subject
from jetfleet.outcome_events import read_outcome
from jetfleet.schemas import AttemptRecord, Outcome

log = logging.getLogger(__name__)

MAX_EVENTS_READ = 1000
"""Outcome events read per job at most from an old per-job subject (a job's own are one
per grant)."""
MAX_HISTORY = 100
"""Attempts a history keeps at most (the newest), in a ledger entry and in a dead letter,
so either stays well within a message: each record's text is cut (``MAX_RECORD_TEXT``)."""
MAX_RECORD_TEXT = 256
"""The longest worker, identity, outcome or reason a ledger entry keeps of a released
attempt's record (a worker's are far shorter; a longer one is cut, not refused)."""


def record_of(event: Outcome) -> AttemptRecord:
    """The attempt record of an outcome event: what a history keeps of it."""
    return AttemptRecord(
        attempt=event.attempt,
        worker=event.worker,
        identity=event.identity,
        fence=event.fence,
        duration_s=event.duration_s,
        outcome=event.kind,
        reason=event.reason,
    )


def with_attempt(
    attempts: list[AttemptRecord], record: AttemptRecord, grants: int
) -> list[AttemptRecord]:
    """``attempts`` (a ledger entry's) with ``record`` added: ``attempts`` itself when an
    attempt of the same fence is there already (a release asked again, or a forgery
    after the real one), else the records ordered by fence (the leaser's, never the
    worker's attempt number), the newest ``MAX_HISTORY`` kept. The record's attempt
    number is clamped to ``grants`` (the entry's grant count: no attempt is numbered
    past the grants made) and its text cut to ``MAX_RECORD_TEXT``."""
    if any(kept.fence == record.fence for kept in attempts):
        return attempts
    cut = msgspec.structs.replace(
        record,
        attempt=min(max(record.attempt, 0), grants),
        worker=record.worker[:MAX_RECORD_TEXT],
        identity=record.identity[:MAX_RECORD_TEXT],
        outcome=record.outcome[:MAX_RECORD_TEXT],
        reason=record.reason[:MAX_RECORD_TEXT],
    )
    return sorted([*attempts, cut], key=lambda kept: kept.fence)[-MAX_HISTORY:]


async def old_attempts(nc: NatsClient, target: str, job_id: str) -> list[AttemptRecord]:
    """The job's attempts stored as outcome events on its old per-job subject
    (``subjects.outcome``; one batched direct get, a miss for jobs that ran after the
    switch). Anyone may publish there, so an event ``read_outcome`` refuses is skipped
    (and logged) rather than keep the job from its dead letter for ever, and the read
    is bounded (``MAX_EVENTS_READ``). A failed read, by contrast, is raised (the caller
    tries again later) rather than writing a history with holes."""
    subject = subjects.outcome(target, job_id)
    stored = await read_subject(nc, subjects.STREAM_OUTCOMES, subject, limit=MAX_EVENTS_READ)
    if len(stored) == MAX_EVENTS_READ:
        log.warning("read only the first %d outcome events on %s", MAX_EVENTS_READ, subject)
    records = []
    for msg in stored:
        event = read_outcome(subject, msg.data)
        if isinstance(event, str):
            log.warning("skipped outcome event %d on %s: %s", msg.seq, subject, event)
            continue
        records.append(record_of(event))
    return records


def merged_history(
    job_id: str, recorded: Iterable[AttemptRecord], reported: Sequence[AttemptRecord]
) -> list[AttemptRecord]:
    """Every attempt of the job, oldest first: ``recorded`` (its ledger entry's, and any
    old events; later ones win for the same attempt and fence), with the worker's own
    records (``reported``) winning for the attempts they cover. At most ``MAX_HISTORY``:
    the worker's own and the newest others."""
    by_attempt: dict[tuple[int, int], AttemptRecord] = {}
    for record in recorded:
        by_attempt[_order(record)] = record
    for record in reported:
        by_attempt[_order(record)] = record
    keys = sorted(by_attempt)
    if len(keys) > MAX_HISTORY:
        log.warning(
            "job %s has %d attempts on record; its history keeps the worker's own and "
            "the newest others, %d in all",
            job_id,
            len(keys),
            MAX_HISTORY,
        )
        own = {_order(r) for r in reported}
        others = [k for k in keys if k not in own]
        keys = sorted(own | set(others[len(others) - max(0, MAX_HISTORY - len(own)) :]))
    return [by_attempt[k] for k in keys]


async def attempt_history(
    nc: NatsClient,
    target: str,
    job_id: str,
    entry_attempts: Sequence[AttemptRecord],
    reported: Sequence[AttemptRecord],
) -> list[AttemptRecord]:
    """Every attempt of the job for its dead letter: ``old_attempts`` merged with its
    ledger entry's (``entry_attempts``) and the worker's own (``reported``), as
    ``merged_history`` says."""
    old = await old_attempts(nc, target, job_id)
    return merged_history(job_id, [*old, *entry_attempts], reported)


def _order(record: AttemptRecord) -> tuple[int, int]:
    # By fence first, the leaser's order (the worker's attempt number is only what it
    # says); by attempt among equal fences (0 when leases are off).
    return record.fence, record.attempt
