"""A job's attempt history, rebuilt from its outcome events for its dead letter."""

from __future__ import annotations

import logging

from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.direct_batch import read_subject
from jetfleet.outcome_events import read_outcome
from jetfleet.schemas import AttemptRecord

log = logging.getLogger(__name__)

MAX_EVENTS_READ = 1000
"""Outcome events read per job at most (a job's own are one per grant)."""
MAX_HISTORY = 100
"""Attempts a history keeps at most (the newest), so a dead letter stays well within a
message: each record comes from an event of at most ``MAX_OUTCOME_BYTES``."""


async def attempt_history(
    nc: NatsClient, target: str, job_id: str, reported: list[AttemptRecord]
) -> list[AttemptRecord]:
    """Every attempt of the job, oldest first: its outcome events (one batched direct get),
    with the worker's own records (``reported``) winning for the attempts they cover.

    Workers store a failed attempt's event before reporting it; the worker's report also
    carries the attempt that ended the job, in case its event was lost. Anyone may
    publish on an outcome subject, so an event ``read_outcome`` refuses is skipped (and
    logged) rather than keep the job from its dead letter for ever, and the history is
    bounded (``MAX_EVENTS_READ``, ``MAX_HISTORY``). A failed read, by contrast, is raised
    (the worker tries again later) rather than writing a history with holes.
    """
    by_attempt: dict[tuple[int, int], AttemptRecord] = {}
    subject = subjects.outcome(target, job_id)
    stored = await read_subject(nc, subjects.STREAM_OUTCOMES, subject, limit=MAX_EVENTS_READ)
    if len(stored) == MAX_EVENTS_READ:
        log.warning("read only the first %d outcome events on %s", MAX_EVENTS_READ, subject)
    for msg in stored:
        event = read_outcome(subject, msg.data)
        if isinstance(event, str):
            log.warning("skipped outcome event %d on %s: %s", msg.seq, subject, event)
            continue
        by_attempt[(event.attempt, event.fence)] = AttemptRecord(
            attempt=event.attempt,
            worker=event.worker,
            identity=event.identity,
            fence=event.fence,
            duration_s=event.duration_s,
            outcome=event.kind,
            reason=event.reason,
        )
    for record in reported:
        by_attempt[(record.attempt, record.fence)] = record
    keys = sorted(by_attempt)
    if len(keys) > MAX_HISTORY:
        log.warning(
            "job %s has %d attempts on record; its history keeps the worker's own and "
            "the newest others, %d in all",
            job_id,
            len(keys),
            MAX_HISTORY,
        )
        own = {(r.attempt, r.fence) for r in reported}
        others = [k for k in keys if k not in own]
        keys = sorted(own | set(others[len(others) - max(0, MAX_HISTORY - len(own)) :]))
    return [by_attempt[k] for k in keys]
