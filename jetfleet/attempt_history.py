"""A job's attempt history, rebuilt from its outcome events for its dead letter."""

from __future__ import annotations

import msgspec
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.schemas import AttemptRecord, Outcome
from jetfleet.stream_reader import read_stream

_decoder = msgspec.json.Decoder(Outcome)


async def attempt_history(
    js: JetStreamContext, target: str, job_id: str, reported: list[AttemptRecord]
) -> list[AttemptRecord]:
    """Every attempt of the job, oldest first: its outcome events, with the worker's own
    records (``reported``) winning for the attempts they cover.

    Outcome events are published without waiting for the stream, so the newest may not be
    stored yet; the worker's report always carries the attempt that ended the job.
    """
    by_attempt: dict[tuple[int, int], AttemptRecord] = {}
    filter_ = subjects.outcome(target, job_id)
    async for msg in read_stream(js, subjects.STREAM_OUTCOMES, filter_):
        event = _decoder.decode(msg.data)
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
