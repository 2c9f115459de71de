"""A job's attempt history, rebuilt from its outcome events for its dead letter."""

from __future__ import annotations

import logging

import msgspec
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.direct_batch import read_subject
from jetfleet.schemas import AttemptRecord, Outcome

log = logging.getLogger(__name__)
_decoder = msgspec.json.Decoder(Outcome)


async def attempt_history(
    nc: NatsClient, target: str, job_id: str, reported: list[AttemptRecord]
) -> list[AttemptRecord]:
    """Every attempt of the job, oldest first: its outcome events (one batched direct get),
    with the worker's own records (``reported``) winning for the attempts they cover.

    Workers store a failed attempt's event before reporting it; the worker's report also
    carries the attempt that ended the job, in case its event was lost.
    """
    by_attempt: dict[tuple[int, int], AttemptRecord] = {}
    subject = subjects.outcome(target, job_id)
    for msg in await read_subject(nc, subjects.STREAM_OUTCOMES, subject):
        try:
            event = _decoder.decode(msg.data)
        except msgspec.MsgspecError as exc:
            # Anyone may publish on an outcome subject: one bad event must not keep the
            # job from its dead letter for ever. A failed read, by contrast, is raised
            # (the worker tries again later) rather than writing a history with holes.
            log.warning("skipped an undecodable outcome event on %s: %s", subject, exc)
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
    return [by_attempt[k] for k in sorted(by_attempt)]
