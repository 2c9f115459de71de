"""Reading outcome events off ``jf.outcome.>``, where anyone may publish.

Workers publish on ``jf.outcome.<target>`` with the job id in the ``Jf-Job`` header;
events from before that sit on ``jf.outcome.<target>.<job id>`` until their retention
ends, and every reader takes both. Every reader (the quarantine rules and breaker, the
gateway's tail, ``jetfleet doctor``, a dead letter's history of old events) takes an
event only through ``read_outcomes`` (or ``read_outcome`` where no batch can be): one
that is oversized, does not decode, names another job or target than its subject and
header, or carries an impossible duration is skipped with a reason, and never stops the
reader or the dead letter it feeds.

A worker sends its successes (``ok`` events, telemetry) in batches: one message holds up
to ``MAX_BATCH_EVENTS`` events of one target (an ``OutcomeBatch``), with the count in the
``Jf-Batch`` header and no ``Jf-Job``. Failures stay one event a message: the rules name
their stream sequences as evidence and count each sequence once, so a batch is read only
for its ``ok`` events (anything else in it is skipped).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import msgspec

from jetfleet import subjects
from jetfleet.schemas import Outcome

MAX_OUTCOME_BYTES = 8192
"""The largest event read. A worker's own is far smaller (its detail is cut at 500
characters); a larger one would be copied into dead letters and reports."""

JOB_HEADER = "Jf-Job"
"""The header naming the job of an event on a per-target subject (``jf.outcome.<target>``)."""

BATCH_HEADER = "Jf-Batch"
"""The header of a message holding several ``ok`` events (its value: how many)."""

MAX_BATCH_EVENTS = 64
"""The most events one batch holds (a worker's sends at most this many)."""

MAX_BATCH_BYTES = MAX_OUTCOME_BYTES * MAX_BATCH_EVENTS
"""The largest batch read."""

OK_HOLD_S = 0.05
"""How long a worker holds an ``ok`` event for its batch at most: an ``ok`` event may be
stored this much after a failure that came after it."""

_decoder = msgspec.json.Decoder(Outcome)


class _RawBatch(msgspec.Struct, frozen=True):
    """An ``OutcomeBatch`` with its events left undecoded, to bound each one's size."""

    events: list[msgspec.Raw]


_batch_decoder = msgspec.json.Decoder(_RawBatch)
_PREFIX = f"{subjects.PREFIX}.outcome."


def read_outcome(
    subject: str, data: bytes, headers: Mapping[str, str] | None = None
) -> Outcome | str:
    """The outcome event ``data`` stored on ``subject`` with ``headers``, or why it is
    skipped. The job it must name is the subject's last token on a per-job subject, the
    ``Jf-Job`` header on a per-target one (an event there without the header is skipped).

    Returns:
        The event, or a sentence saying what is wrong with it (for the log).
    """
    if len(data) > MAX_OUTCOME_BYTES:
        return f"{len(data)} bytes, over the {MAX_OUTCOME_BYTES} an outcome event may have"
    try:
        event = _decoder.decode(data)
    except (msgspec.MsgspecError, RecursionError) as exc:  # RecursionError: nested too deep
        return f"does not decode as an Outcome: {exc}"
    target, per_job, job_id = subject.removeprefix(_PREFIX).partition(".")
    if not per_job:
        job_id = (headers or {}).get(JOB_HEADER, "")
        if not job_id:
            return f"no {JOB_HEADER} header on a per-target subject: names no job"
    return _checked(event, target, job_id)


def read_outcomes(
    subject: str, data: bytes, headers: Mapping[str, str] | None = None
) -> list[Outcome | str]:
    """The events of one stored message: a batch's (``Jf-Batch`` header) each in turn,
    else the one ``read_outcome`` reads. Each item is an event or why it is skipped; a
    batch that cannot be read at all is one reason.
    """
    if not headers or BATCH_HEADER not in headers:
        return [read_outcome(subject, data, headers)]
    if len(data) > MAX_BATCH_BYTES:
        return [f"{len(data)} bytes, over the {MAX_BATCH_BYTES} an outcome batch may have"]
    target, per_job, _ = subject.removeprefix(_PREFIX).partition(".")
    if per_job:
        return [f"a batch on a per-job subject ({subject[:200]}): batches are per target"]
    try:
        raws = _batch_decoder.decode(data).events
    except (msgspec.MsgspecError, RecursionError) as exc:
        return [f"does not decode as an OutcomeBatch: {exc}"]
    if not 0 < len(raws) <= MAX_BATCH_EVENTS:
        return [f"a batch of {len(raws)} events: 1 to {MAX_BATCH_EVENTS} may be sent"]
    if headers[BATCH_HEADER] != str(len(raws)):
        return [f"{BATCH_HEADER} says {headers[BATCH_HEADER][:20]!r}, the batch holds {len(raws)}"]
    read: list[Outcome | str] = []
    for raw in raws:
        # Each event within the bound a lone one has: a batch is no way around it.
        if len(raw) > MAX_OUTCOME_BYTES:
            read.append(f"an event of {len(raw)} bytes in a batch, over {MAX_OUTCOME_BYTES}")
            continue
        try:
            event = _decoder.decode(raw)
        except (msgspec.MsgspecError, RecursionError) as exc:
            read.append(f"an event in a batch does not decode as an Outcome: {exc}")
            continue
        if event.kind != "ok":
            # A failure is evidence by its own sequence; in a batch it would share one.
            read.append(f"a {event.kind[:32]!r} event in a batch: only ok events are batched")
        elif not event.job_id:
            read.append("an event in a batch names no job")
        else:
            read.append(_checked(event, target, event.job_id))
    return read


def _checked(event: Outcome, target: str, job_id: str) -> Outcome | str:
    """``event`` if it names ``job_id`` of ``target`` and its numbers are possible."""
    if (event.target, event.job_id) != (target, job_id):
        return (
            f"names job {event.job_id[:128]!r} of target {event.target[:64]!r}, not the "
            f"job and target of its subject and {JOB_HEADER} header"
        )
    if not math.isfinite(event.duration_s) or event.duration_s < 0:
        return f"duration_s is {event.duration_s!r}, not a finite number >= 0"
    if event.attempt < 0 or event.fence < 0:
        return f"attempt {event.attempt} and fence {event.fence} must not be negative"
    return event
