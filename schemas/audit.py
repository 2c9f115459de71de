"""The audit log: one entry per control action, on ``jf.audit.<action>`` (kept in
``JF_AUDIT``). When it happened is the stream message's server timestamp, never a
clock of the sender's (I9: no wall-clock times in payloads). docs/audit.md."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

AuditAction = Annotated[
    str, msgspec.Meta(pattern=r"^[a-z][a-z0-9-]*(\.[a-z][a-z0-9-]*)*$", max_length=64)
]
"""What was done, as subject tokens: ``quarantine.set``, ``breaker.close``,
``target.set``, ``dlq.replay``, ``dlq.purge``, ``pause``, ``versions.approve``..."""
AuditOutcome = Literal["done", "refused", "failed"]


class AuditEntry(msgspec.Struct, frozen=True, omit_defaults=True):
    """One control action: who did what to which scope, why, and how it ended."""

    action: AuditAction
    who: str
    """Who asked: ``--as NAME`` or the OS user for a person, ``rule:<name>`` for a rule."""
    what: str
    """The scope acted on, in words (``identity id-1 on demo``, ``target demo``)."""
    why: str = ""
    outcome: AuditOutcome = "done"
    detail: str = ""
    """What came of it (jobs revoked, letters replayed), or why it was refused."""
