"""The approved version set (I8; docs/versions.md): its records in ``jf-control``, the
commands the leaser serves on ``jf.versions``, and the rollout guard's alert on
``jf.alert._versions``.

Times are the server's: when a tuple was approved, seen or withdrawn is the stored
timestamp of its KV entry, never a time a payload carries; listings show ages (I9).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from jetfleet.schemas.job import ShortText
from jetfleet.schemas.report import Versions

TupleId = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{12}$")]
"""A version tuple's id: 12 lowercase hex digits (jetfleet/version_tuple.py)."""
Why = Annotated[str, msgspec.Meta(max_length=1024, pattern=r"^[^\x00-\x1f\x7f]*$")]
"""Why an operator or the guard acted: printable, at most 1024 characters."""


class GuardFigures(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the rollout guard counted when it withdrew a tuple."""

    window_s: float
    fraction: float
    sample: int
    success_rate: float
    block_rate: float
    incumbent: str
    incumbent_sample: int
    incumbent_success_rate: float
    incumbent_block_rate: float


class VersionApproval(msgspec.Struct, frozen=True, omit_defaults=True):
    """An approved tuple, in ``jf-control`` under ``version-approved.<id>`` (no TTL)."""

    versions: Versions
    by: str = ""
    why: str = ""


class VersionWithdrawal(msgspec.Struct, frozen=True, omit_defaults=True):
    """Why a tuple left the approved set, under ``version-withdrawn.<id>`` (no TTL; a new
    approval of the tuple deletes it)."""

    versions: Versions | None = None
    by: str = ""
    """``rollout-guard``, or the operator who revoked it."""
    why: str = ""
    figures: GuardFigures | None = None
    """The guard's counts, when the guard withdrew it."""


class VersionSighting(msgspec.Struct, frozen=True, omit_defaults=True):
    """A tuple some worker asked for a lease with, under ``version-seen.<id>`` with a
    per-key TTL: written at most once per tuple per leaser replica every few minutes."""

    versions: Versions
    worker: str = ""


class VersionsList(msgspec.Struct, frozen=True, tag="list"):
    """List the approved, seen and withdrawn tuples."""


class VersionsApprove(msgspec.Struct, frozen=True, tag="approve", omit_defaults=True):
    """Approve a tuple: by ``versions`` (``--current``: the tuple the sender's machine
    advertises), or by ``id`` of a tuple a leaser has seen."""

    id: str = ""
    versions: Versions | None = None
    by: ShortText = ""
    why: Why = ""


class VersionsRevoke(msgspec.Struct, frozen=True, tag="revoke", omit_defaults=True):
    """Withdraw a tuple from the approved set (an operator, or the rollout guard)."""

    id: TupleId
    by: ShortText = ""
    why: Why = ""
    figures: GuardFigures | None = None
    """The rollout guard's counts (the guard sends them; an operator does not)."""


class VersionsGuard(msgspec.Struct, frozen=True, tag="guard", omit_defaults=True):
    """Turn the rollout guard on or off fleet-wide (the ``version-guard`` key)."""

    on: bool
    by: ShortText = ""
    why: Why = ""


VersionsCommand = VersionsList | VersionsApprove | VersionsRevoke | VersionsGuard


class ApprovedShown(msgspec.Struct, frozen=True, omit_defaults=True):
    """An approved tuple as listed."""

    id: str
    versions: Versions
    by: str = ""
    why: str = ""
    age_s: float = -1.0
    """Seconds since the approval was stored, by the NATS server's clock (-1: the
    server's time could not be read, as for every ``age_s`` here)."""
    incumbent: bool = False
    """The approved tuple approved earliest: what the rollout guard compares with."""


class SeenShown(msgspec.Struct, frozen=True, omit_defaults=True):
    """A tuple a leaser was asked with lately."""

    id: str
    versions: Versions
    worker: str = ""
    age_s: float = -1.0
    """Seconds since a leaser last recorded it, by the NATS server's clock."""
    approved: bool = False


class WithdrawnShown(msgspec.Struct, frozen=True, omit_defaults=True):
    """A withdrawn tuple, with why."""

    id: str
    by: str = ""
    why: str = ""
    age_s: float = -1.0
    """Seconds since it was withdrawn, by the NATS server's clock."""
    figures: GuardFigures | None = None


GuardState = Literal["on", "off"]


class VersionView(msgspec.Struct, frozen=True, omit_defaults=True):
    """The approved set, the tuples seen lately, and those withdrawn."""

    approved: list[ApprovedShown] = []
    seen: list[SeenShown] = []
    withdrawn: list[WithdrawnShown] = []
    guard: GuardState = "on"
    """The fleet-wide switch (``jetfleet versions guard``); the guard also needs
    ``versions.guard_enabled`` in the quarantine service's settings."""
    gate: str = ""
    """The answering leaser's ``versions.gate``."""


class VersionsReply(msgspec.Struct, frozen=True, omit_defaults=True):
    """The leaser's answer to a versions command."""

    ok: bool
    detail: str = ""
    view: VersionView | None = None
    retry_after_s: float = 0.0
    """With ``ok`` false: not done (busy, or JetStream did not answer): send it again
    after this many seconds. 0: refused, final."""


class VersionAlert(msgspec.Struct, frozen=True, omit_defaults=True):
    """On ``jf.alert._versions`` (kept in ``JF_ALERTS``): a tuple was withdrawn."""

    id: str
    change: Literal["withdrawn"] = "withdrawn"
    by: str = ""
    why: str = ""
    figures: GuardFigures | None = None
