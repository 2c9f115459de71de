"""The pause switch: the commands the leaser serves on ``jf.pause``, the records it keeps
in ``jf-control`` under ``pause.<scope>.<name>`` and its answers (docs/pause.md).

A pause names a scope (the fleet, a target, a region, a worker or an identity) and lasts
``for_s`` seconds (0: until resumed). It is a duration, never a deadline (I9): the record
lapses by the server's per-key TTL, and the work consumers it pauses at the server resume
at the same moment by the server's clock.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from jetfleet.schemas.job import ShortText
from jetfleet.schemas.names import Name

PauseScope = Literal["fleet", "target", "region", "worker", "identity"]
"""What a pause keeps from work: everything, one target's jobs, the workers of a region,
one worker, or one identity (on whichever worker holds it)."""
PauseMode = Literal["drain", "now"]
"""``drain``: leases held when the pause lands run to their end; ``now``: they are
revoked and their jobs requeued (their attempt given back)."""
FLEET_NAME = "_"
"""The name a fleet pause is kept under (``pause.fleet._``)."""
MAX_PAUSE_S = 30 * 24 * 3600.0
"""The longest timed pause (30 days); longer ones are untimed (``for_s`` 0)."""

PauseSeconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_PAUSE_S)]


class PauseRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    """A pause in force, in ``jf-control`` under ``pause.<scope>.<name>`` (with the
    per-key TTL ``for_s`` when it is timed)."""

    scope: PauseScope
    name: str = FLEET_NAME
    for_s: float = 0.0
    """How long it lasts from when the server stored it (0: until resumed)."""
    mode: PauseMode = "drain"
    by: str = ""
    """Who paused (for the audit)."""
    why: str = ""


class PauseView(msgspec.Struct, frozen=True, omit_defaults=True):
    """A pause in force as listed: its record, when the server stored it and what is
    left of it by the server's clock."""

    record: PauseRecord
    age_s: float = 0.0
    """Seconds since the server stored the record, by the server's clock (the record's
    revision below names the message: its stored time is the pause's start)."""
    left_s: float = 0.0
    """Seconds left by the server's clock (0: until resumed)."""
    revision: int = 0
    """The record's ``jf-control`` revision."""


class PauseSet(msgspec.Struct, frozen=True, tag="pause", omit_defaults=True):
    """Pause a scope: no lease is granted in it, and for the fleet or a target the work
    consumers are paused at the server too."""

    scope: PauseScope
    name: Name = ""
    """The target, region, worker or identity (empty for the fleet)."""
    for_s: PauseSeconds = 0.0
    """How long (0: until resumed). A duration, never a deadline (I9)."""
    mode: PauseMode = "drain"
    by: ShortText = ""
    why: ShortText = ""


class PauseResume(msgspec.Struct, frozen=True, tag="resume", omit_defaults=True):
    """End a scope's pause: its grants (and its consumers, unless another pause still
    covers them) resume."""

    scope: PauseScope
    name: Name = ""
    by: ShortText = ""
    why: ShortText = ""


class PauseList(msgspec.Struct, frozen=True, tag="list"):
    """List the pauses in force."""


PauseCommand = PauseSet | PauseResume | PauseList


class PauseReply(msgspec.Struct, frozen=True, omit_defaults=True):
    """The leaser's answer to a pause command, sent once this replica refuses grants in
    the scope (a pause) or grants them again (a resume)."""

    ok: bool
    detail: str = ""
    pauses: list[PauseView] = []
    """A pause: the record in force (its ``revision`` is the ``jf-control`` message, so
    its server time is known). A list: every pause in force."""
    revoked: list[str] = []
    """``now``: the job ids whose leases were revoked and requeued."""
    consumers: list[str] = []
    """A pause: the work consumers it holds at the server. A resume: those it let go
    (none another pause still holds)."""
    retry_after_s: float = 0.0
    """With ``ok`` false: not finished (busy, or JetStream slow): send it again after
    this many seconds. 0: refused, final."""
