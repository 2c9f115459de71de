"""Internal types of the worker: what an attempt came to, and the lease it holds."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

from jetfleet.schemas import AttemptRecord, HandlerOutput
from jetfleet.worker.ack_timer import AckTimer


@dataclass(frozen=True)
class Verdict:
    """An attempt's result before the sink has its say.

    ``kind`` is ok, retryable, permanent, blocked (the target refused us: back off),
    lost (the lease went to someone else), or unrun (no rate permit for its request:
    nothing was sent, the job goes back with its attempt refunded).
    """

    kind: str
    output: HandlerOutput | None = None
    reason: str = ""
    detail: str = ""
    delay_s: float | None = None
    attempt_reason: str = ""
    """The attempt's own reason when ``reason`` is about the job (attempts-exhausted)."""
    called: bool = True
    """Whether the target was called (False: judged without running the handler)."""
    status: int = 0
    """The HTTP status of a blocked answer (0 when not known)."""
    asked_s: float | None = None
    """What a blocked answer's Retry-After asked for (cut to the target's maximum);
    None when it gave none."""


MAX_REASON_CHARS = 1024
"""The longest reason the wire takes (``schemas.report.FailureReason``)."""
_CONTROL_RUN = re.compile(r"[\x00-\x1f\x7f]+")


def fit_reason(reason: str) -> tuple[str, str]:
    """A handler's own reason as the wire takes it, and a note when it had to change.

    A reason becomes a dead letter's ``Jf-Reason`` header, so the sink refuses line
    breaks and more than ``MAX_REASON_CHARS``. Sent as raised, such a reason would make
    every report of its job an ``error``: the job would run again until its attempts
    were spent, for want of a shorter word.
    """
    fitted = _CONTROL_RUN.sub(" ", reason).strip()
    if len(fitted) > MAX_REASON_CHARS:
        fitted = fitted[: MAX_REASON_CHARS - 3].rstrip() + "..."
    fitted = fitted or "handler-failed"
    if fitted == reason:
        return reason, ""
    return fitted, f"the handler's reason was cut to fit ({len(reason)} characters, no line breaks)"


def target_answered(verdict: Verdict | None) -> bool:
    """Whether ``verdict`` shows the target answering normally, which ends the probing
    after a block: the handler called it, kept its lease, and was not blocked. A job
    not leased (None), lost, or judged without a call says nothing about the target."""
    return verdict is not None and verdict.called and verdict.kind not in ("lost", "blocked")


@dataclass
class Held:
    """The lease this delivery runs under (fence 0: leases are off)."""

    fence: int
    ttl_s: float
    attempt: int
    asked_at: float = 0.0
    """When the grant was asked for (monotonic): its TTL runs from no earlier than that."""
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    running: asyncio.Task[Verdict] | None = None
    """The handler's task while it runs: cancelled if the lease is lost."""
    timer: AckTimer | None = None
    """The delivery's ack wait (None: not tracked, leases off)."""
    record: AttemptRecord | None = None
    """The attempt's record once its outcome event is published (None before, and for a
    delivery that sent nothing): every release of the lease from then on carries it, so
    the leaser keeps it in the job's history."""

    def may_nak_unanswered(self) -> bool:
        """Whether a nak may follow a release the leaser did not answer: only while the
        lease is not known lost and the delivery's ack wait surely has not run out, or
        the nak could land on a delivery already handed to another worker."""
        return not self.lost.is_set() and self.timer is not None and self.timer.still_ours()
