"""Landing a job's terminal decision: writing the record its seal carries.

A job is settled in two writes (docs/commit.md#the-settle-rule): the seal in
``jf-fences`` (a compare-and-set that also stops every later grant), then the record
itself, a committed result or a dead letter. Both record writes are put-if-absent with a
message id, so anyone may land a seal again, whether the sink that sealed it, another
sink replica answering the worker's retried report, or the leaser meeting the job's next
delivery. Landing twice writes once. That is why a sink dying between its two writes
strands nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import APIError

from jetfleet import subjects
from jetfleet.js_errors import is_wrong_last_sequence
from jetfleet.publish import publish_durably
from jetfleet.results import committed_job
from jetfleet.schemas import SinkReply
from jetfleet.schemas.lease import Sealed, SealedCommit, SealedDeath

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()
# Put-if-absent: the stream stores the message only if its subject has none yet.
_IF_ABSENT = {"Nats-Expected-Last-Subject-Sequence": "0"}


async def land(
    js: JetStreamContext,
    sealed: Sealed,
    dedupe: bool = True,
    on_letter_written: Callable[[], None] | None = None,
) -> SinkReply:
    """Write the record ``sealed`` carries; the sink's answer for it.

    ``dedupe=False`` writes a result without its guards (only ``jetfleet scenario``, to
    show why they exist). ``on_letter_written`` is called when this call stored a dead
    letter, not when the letter was there already (a seal landed again answers
    ``dead-lettered`` too): what counts letters, not answers.
    """
    if isinstance(sealed, SealedDeath):
        return await _land_letter(js, sealed, on_letter_written)
    return await _land_result(js, sealed, dedupe)


async def _land_result(js: JetStreamContext, sealed: SealedCommit, dedupe: bool) -> SinkReply:
    result = sealed.result
    subject = subjects.result_key(result.target, result.key)
    payload = _encoder.encode(result)
    if not dedupe:
        ack = await publish_durably(js, subject, payload, msg_id=None)
        return SinkReply(status="committed", detail=str(ack.seq))
    try:
        # The msg id also turns a re-sent write (a lost ack, a retried publish, a seal
        # landed again) into a duplicate inside the stream's window; the header holds
        # after it.
        ack = await publish_durably(
            js, subject, payload, msg_id=f"res-{result.key}", headers=_IF_ABSENT
        )
    except APIError as exc:
        if is_wrong_last_sequence(exc):
            return await _suppressed(js, result.target, result.key)
        raise
    if ack.duplicate:
        return await _suppressed(js, result.target, result.key)
    return SinkReply(status="committed", detail=str(ack.seq))


async def _suppressed(js: JetStreamContext, target: str, key: str) -> SinkReply:
    holder = await committed_job(js, target, key)
    return SinkReply(status="suppressed:duplicate-key", detail=key, committed_by=holder or "")


async def _land_letter(
    js: JetStreamContext, sealed: SealedDeath, on_written: Callable[[], None] | None
) -> SinkReply:
    letter = sealed.letter
    order = letter.order
    try:
        # Acked by the stream BEFORE the worker terminates the message.
        ack = await publish_durably(
            js,
            subjects.dead_letter(order.target, order.job.id),
            _encoder.encode(letter),
            msg_id=f"dlq-{order.job.id}",
            headers={**_IF_ABSENT, "Jf-Reason": letter.reason, "Jf-Job": order.job.id},
        )
    except APIError as exc:
        if not is_wrong_last_sequence(exc):
            raise
        # The letter is there already: this seal was landed before.
    else:
        if not ack.duplicate and on_written is not None:
            on_written()
    log.info("dead-lettered %s: %s", order.job.id, letter.reason)
    return SinkReply(status="dead-lettered", detail=letter.reason)
