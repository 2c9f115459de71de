"""The per-target circuit breaker: its record in ``jf-control``, the commands the leaser
serves on ``jf.breaker``, and the alerts it publishes on ``jf.alert.<target>``.

A breaker is open while its cooling key lives (a per-key TTL, the server's clock), then
half-open: one probe lease at a time, fleet-wide, whose outcome closes or re-opens it
(docs/quarantine.md#the-target-circuit-breaker).
"""

from __future__ import annotations

from typing import Literal

import msgspec
from jetfleet.schemas.job import ShortText
from jetfleet.schemas.lease import Evidence
from jetfleet.schemas.names import TargetName


class BreakerRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    """An open (or half-open) breaker of one target, in ``jf-control`` under
    ``breaker.<target>``; it lasts until a probe or an operator closes it."""

    target: str
    cool_s: float
    """How long this opening pauses the target (a duration, never a deadline: I9)."""
    reason: str = ""
    opened_by: str = ""
    """``breaker`` (K identities refused), or ``probe`` (a probe was refused again)."""
    identities: list[str] = []
    """The distinct identities (``worker:<id>`` for a worker without one) refused."""
    evidence: list[Evidence] = []
    """The outcome events that opened it (at most ``quarantine.max_evidence``)."""
    opens: int = 1
    """How many times it opened in a row (each refused probe adds one)."""


class BreakerProbe(msgspec.Struct, frozen=True, omit_defaults=True):
    """The one probe lease of a half-open breaker, in ``jf-control`` under
    ``breaker-probe.<target>`` with the lease's TTL: it lapses with the lease."""

    job_id: str
    worker: str
    fence: int = 0
    """The probe lease's fence once granted (0: being granted); its outcome names it."""


BreakerState = Literal["open", "half-open", "probing"]


class BreakerView(msgspec.Struct, frozen=True, omit_defaults=True):
    """A breaker as listed: its record, and where it is now."""

    record: BreakerRecord
    state: BreakerState
    probe: BreakerProbe | None = None


class BreakerOpen(msgspec.Struct, frozen=True, tag="open", omit_defaults=True):
    """Open a target's breaker: no grant there, its live leases revoked and requeued."""

    record: BreakerRecord
    after_opens: int = 0
    """0: a first opening (kept as it is if one is open). N: re-open the breaker opened N
    times in a row because its probe was refused; ignored unless it still is."""


class BreakerClose(msgspec.Struct, frozen=True, tag="close", omit_defaults=True):
    """Close a target's breaker: its jobs are granted again."""

    target: TargetName
    opens: int = 0
    """Close only the breaker opened this many times in a row (a probe's verdict); 0:
    whichever is open (an operator)."""
    by: ShortText = "operator"
    reason: ShortText = ""


class BreakerList(msgspec.Struct, frozen=True, tag="list"):
    """List the breakers open or half-open."""


BreakerCommand = BreakerOpen | BreakerClose | BreakerList


class BreakerReply(msgspec.Struct, frozen=True, omit_defaults=True):
    """The leaser's answer to a breaker command."""

    ok: bool
    detail: str = ""
    breakers: list[BreakerView] = []
    revoked: list[str] = []
    """Job ids whose leases were revoked and requeued at once."""
    fired_seq: int = 0
    """For an opening refused as ``already-fired``: the newest ``JF_OUTCOMES`` sequence
    that opened it before (the events after it count on)."""
    retry_after_s: float = 0.0
    """With ``ok`` false: the leaser did not finish the command (full, or JetStream did
    not answer in time): send it again after this many seconds. 0: refused, final."""


BreakerChange = Literal["opened", "reopened", "closed"]


class BreakerAlert(msgspec.Struct, frozen=True, omit_defaults=True):
    """On ``jf.alert.<target>`` (kept in ``JF_ALERTS``): a breaker opened, re-opened or
    closed."""

    target: str
    change: BreakerChange
    reason: str = ""
    by: str = ""
    cool_s: float = 0.0
    opens: int = 0
    identities: list[str] = []
