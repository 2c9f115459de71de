"""What the sink refuses in a report its type admits, before it reads or writes anything.

Which answer, and why (docs/commit.md#what-the-sink-refuses):

- ``error`` for a report that is wrong in itself: its work order names another target
  than its subject, or a key that cannot end a subject. A jetfleet worker never sends
  one (it reports on its order's own subject, with the key admission made), so only a
  foreign or broken reporter meets it, and ``error`` is what the worker counts against
  the job: the job is retried and then dead-lettered (``attempts-exhausted``).
- ``busy`` for a report on a target this sink does not declare, although the leaser
  granted it: the job is healthy and this sink's settings lag behind. ``error`` would
  spend an attempt, fetch the page again and loop until the backstop; ``busy`` keeps the
  report coming (the same one, the lease renewed, the target asked once) until a sink
  that declares the target takes it.
- ``error`` for a ``Malformed`` report whose work subject names another target than the
  report's subject. Its target need not be declared: keeping an undecodable order needs
  no target settings, and a worker's settings may know a target this sink does not yet.
"""

from __future__ import annotations

import msgspec
from jetfleet.schemas import Report, SinkReply
from jetfleet.schemas.names import IdempotencyKey
from jetfleet.schemas.report import Malformed

from jetfleet import subjects
from jetfleet.errors import ConfigError
from jetfleet.settings import Settings

UNDECLARED_RETRY_S = 5.0
"""How long a worker waits before sending a report on an undeclared target again."""


def refuse_report(settings: Settings, subject: str, report: Report) -> SinkReply | None:
    """The refusal of ``report``, sent on ``subject``, or None to judge it."""
    target = subject.removeprefix(f"{subjects.SINK_REPORT}.")
    if isinstance(report, Malformed):
        if subjects.target_of(report.subject) != target:
            return SinkReply(
                status="error",
                detail=f"report refused: its work subject {report.subject!r} is not of "
                f"target {target!r}: send it on "
                f"{subjects.sink_report(subjects.target_of(report.subject))}",
            )
        return None
    order = report.order
    if order.target != target:
        return SinkReply(
            status="error",
            detail=f"report refused: its order is for target {order.target!r} but it was "
            f"sent on {subject}: send it on {subjects.sink_report(order.target)}",
        )
    try:
        msgspec.convert(order.key, IdempotencyKey)
    except msgspec.ValidationError as exc:
        return SinkReply(status="error", detail=f"report refused: order.key {order.key!r}: {exc}")
    try:
        settings.target(target)
    except ConfigError as exc:
        return SinkReply(
            status="busy",
            retry_after_s=UNDECLARED_RETRY_S,
            detail=f"not settled: this sink does not declare the target ({exc} of the "
            "sink and restart it): send the report again",
        )
    return None
