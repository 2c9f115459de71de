"""Keeping work orders that do not decode on ``jf.rejected.<target>``.

Two ways reach here: a worker's ``Malformed`` report (it was delivered one) and the
backstop (one whose deliveries ran out). Either way the order is kept, with its bytes,
before its message leaves ``JF_WORK``: counted and inspectable, never silently gone. The
message id ``bad-order-<stream seq>`` makes it land once, whoever keeps it first (a
worker of an older version still keeps it itself).

A ``Malformed`` report carries no lease (nothing ran), so nothing in it is trusted but
where to look: the sink reads the message at its sequence from the stream's leader, and
keeps it only if it is on the reported subject and does not decode here either (or
names another target than its subject). The record holds the stored bytes. So a report
can only ever make the sink keep a real, undecodable or self-contradicting work order as
a rejection; it cannot write anything else, nor squat the
message id of another sequence (docs/dead-letters.md#malformed-work-orders).
"""

from __future__ import annotations

import logging
from typing import Final

import msgspec
from jetfleet.schemas import SinkReply, WorkOrder
from jetfleet.schemas.report import Malformed
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from jetfleet import subjects
from jetfleet.admission import rejection
from jetfleet.publish import publish_durably
from jetfleet.settings import Settings
from jetfleet.unrunnable_orders import MALFORMED, TARGET_MISMATCH, unrunnable

log = logging.getLogger(__name__)

REASON = MALFORMED
KEPT: Final = "kept:malformed-work-order"
KEEP_RETRY_S = 1.0
"""How soon a worker sends the report again when the rejection could not be stored."""

_encoder = msgspec.json.Encoder()
_order_decoder = msgspec.json.Decoder(WorkOrder)


async def keep_malformed(
    js: JetStreamContext,
    settings: Settings,
    subject: str,
    seq: int,
    data: bytes,
    error: str,
    reason: str = REASON,
    decoded: bool = False,
) -> None:
    """Store the rejection of the undecodable (or, ``decoded``, unrunnable: another
    target's, or with a key the leaser refuses) work order at ``seq`` of ``JF_WORK`` (its
    first ``fleet.max_job_bytes``, so the record fits max_payload).

    Raises:
        SubmitError: when the stream did not store it.
    """
    if not decoded:
        message = (
            f"the work order could not be decoded ({error}); a scheduler of another "
            "version may have written it"
        )
    elif reason == TARGET_MISMATCH:
        message = (
            f"the work order was not run: {error}; only the scheduler routes orders, "
            "each on its own target's work subject"
        )
    else:
        message = (
            f"the work order was not run: {error}; the leaser grants no lease for it "
            "(keys are what admission derives, schemas/names.py)"
        )
    record = rejection(reason, message, subject, data, settings)
    await publish_durably(
        js,
        subjects.rejected(subjects.target_of(subject)),
        _encoder.encode(record),
        msg_id=f"bad-order-{seq}",
    )
    log.info("kept the undecodable work order at %s seq %d: %s", subject, seq, error)


async def keep_reported(js: JetStreamContext, settings: Settings, report: Malformed) -> SinkReply:
    """Keep the work order ``report`` names, if the stream has it and it is malformed;
    the answer (``kept:malformed-work-order`` once stored; ``busy`` if the store
    failed; ``error`` when there is nothing malformed to keep there)."""
    seq = report.stream_seq
    try:
        stored = await js.get_msg(subjects.STREAM_WORK, seq=seq, direct=False)
    except NotFoundError:
        # Ended already: whoever removed it (another delivery's holder, the backstop)
        # kept it first.
        return _refused(f"no message at sequence {seq} of {subjects.STREAM_WORK}")
    data = stored.data or b""
    if stored.subject != report.subject:
        return _refused(
            f"the message at sequence {seq} is on {stored.subject}, not {report.subject}"
        )
    if not data.startswith(report.raw):
        return _refused(f"the reported bytes are not those of the message at sequence {seq}")
    reason = REASON
    decoded = False
    try:
        order = _order_decoder.decode(data)
    except (msgspec.MsgspecError, RecursionError) as exc:  # RecursionError: nested too deep
        error = str(exc)
    else:
        decoded = True
        objection = unrunnable(order, report.subject)
        if objection is None:
            return _refused(
                f"the work order at sequence {seq} decodes here (is the worker of an older "
                "version?): it is not kept; another worker runs it, or the backstop ends it"
            )
        # It decodes but cannot run (jetfleet/unrunnable_orders.py): another target's,
        # or a key the leaser refuses. Run, it would end nowhere on each delivery. Kept.
        reason, error = objection
    try:
        await keep_malformed(
            js, settings, report.subject, seq, data, error, reason, decoded=decoded
        )
    except Exception as exc:
        log.warning("could not keep the work order at sequence %d: %s", seq, exc)
        return SinkReply(
            status="busy",
            retry_after_s=KEEP_RETRY_S,
            detail=f"not kept, the rejection was not stored ({exc}): send the report again",
        )
    return SinkReply(
        status=KEPT, detail=f"kept on {subjects.rejected(subjects.target_of(report.subject))}"
    )


def _refused(why: str) -> SinkReply:
    return SinkReply(status="error", detail=f"malformed-order report refused: {why}")
