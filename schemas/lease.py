"""Leases: requests to the leaser, its answers, and the records it keeps in KV.

A lease's fence is the KV revision of its grant: it only grows, across all jobs. Expiry is
the server's per-key TTL; no worker or service clock decides whether a lease is alive.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from jetfleet.schemas.events import CommittedResult, DeadLetter
from jetfleet.schemas.job import JobId, ShortText
from jetfleet.schemas.names import (
    IdempotencyKey,
    Name,
    ReplySubject,
    RequiredName,
    TargetName,
)
from jetfleet.schemas.report import AttemptRecord, Versions


class LeaseRequest(msgspec.Struct, frozen=True, tag="grant", omit_defaults=True):
    """Ask for the lease on a job, for the delivery whose reply subject is given. The
    target must be one the leaser declares (else ``refused: unknown-target``)."""

    job_id: JobId
    target: TargetName
    key: IdempotencyKey
    worker: RequiredName
    versions: Versions
    identity: Name = ""
    region: Name = ""
    reply_subject: ReplySubject = ""
    """The JetStream reply subject of the delivery the lease is for (used to requeue it)."""
    pin_identity: ShortText = ""
    """The identity the job is pinned to, if any (as long as ``Job.pin_identity``)."""
    egress: Name = ""
    """The egress the worker's requests leave by (its per-egress rate limit)."""
    subnet: ShortText = ""
    """The network the worker's requests leave from (``worker.subnet``), if declared."""
    pin_region: ShortText = ""
    """The region the job is pinned to, if any (``Job.pin_region``)."""
    sends_request: bool = True
    """True: the grant takes the rate permit of the attempt's first request. Workers
    before permits moved to the worker sent True (the default, so they omit it) unless
    no request followed. A current worker always sends False and takes each permit
    itself, just before the request; so in a fleet mid-upgrade every request still
    pays for exactly one permit, whichever side is older."""


class LeaseRenew(msgspec.Struct, frozen=True, tag="renew"):
    """Extend a held lease; refused unless ``fence`` is still the live one."""

    job_id: JobId
    fence: int


class LeaseRelease(msgspec.Struct, frozen=True, tag="release", omit_defaults=True):
    """Give a lease back early; refused unless ``fence`` is still the live one."""

    job_id: JobId
    fence: int
    refund: bool = False
    """The attempt does not count against the job's budget (the target blocked us)."""
    avoid_reason: ShortText = ""
    """Non-empty: the target refused the attempt there (``challenged``, ``blocked``), so
    the holder's identity (its worker id when it has none) goes on the job's avoid list
    with this reason, before the answer: the job's next delivery goes to someone else."""
    attempt: AttemptRecord | None = None
    """The worker's record of the attempt this release ends (None: no attempt ran, or a
    worker from before this field). The leaser appends it to the job's ledger entry
    (``JobLeaseHistory.attempts``), for its dead letter's history: under the release's
    fence, numbered at most the entry's grant count, once per fence. For a live lease
    the worker and identity are the lease's. Sent also when the lease was lost: refused
    ``lease-lost`` as ever, the record (as sent, its text cut) is appended only if its
    fence is the entry's highest grant (docs/dead-letters.md#what-a-dead-letter-holds)."""


LeaseCall = LeaseRequest | LeaseRenew | LeaseRelease


class LeaseGrant(msgspec.Struct, frozen=True, tag="granted", omit_defaults=True):
    """The lease is yours under ``fence`` for ``ttl_s`` seconds of server time."""

    fence: int
    ttl_s: float
    attempt: int = 1
    """How many times this job has been granted, this grant included."""


AVOID_MAX = 16
"""The most entries a job's avoid list keeps (the oldest go first)."""

LEASE_LOST = "lease-lost"
"""A renew's or release's refusal when the lease is gone or superseded; any other
refusal of those calls (``leaser-error``) leaves the lease's state unknown."""


class LeaseRefusal(msgspec.Struct, frozen=True, tag="refused", omit_defaults=True):
    """No lease: ``reason`` says why, ``retry_after_s`` when to ask again."""

    reason: str
    retry_after_s: float = 0.0
    detail: str = ""
    opens_in_s: float = 0.0
    """``outside-window``: seconds until the target's activity window opens (its
    ``retry_after_s`` is capped, so the worker asks again meanwhile); the job itself may
    stay away this long, spending one delivery, not one per ask."""
    pause_scope: str = ""
    """``paused``: the scope of the pause that refused (``fleet``, ``target``, ``region``,
    ``worker``, ``identity``). A worker, region or identity pause is about this worker
    only: its jobs go on to other workers."""


class LeaseAlreadyDone(msgspec.Struct, frozen=True, tag="already-done", omit_defaults=True):
    """The job's idempotency key is committed: ack it without running it again."""

    key: str
    committed_by: str = ""
    """The job id whose commit holds the key (this job's own after a lost ack)."""


LeaseReply = LeaseGrant | LeaseRefusal | LeaseAlreadyDone


class LeaseRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    """The live lease of a job, kept in ``jf-leases`` under the job id with a per-key TTL."""

    job_id: str
    target: str
    worker: str
    identity: str = ""
    reply_subject: str = ""
    subnet: str = ""
    """The holder's subnet (``LeaseRequest.subnet``), so a quarantine of it finds its
    leases."""
    fence: int = 0
    """0 on the grant itself (its fence is that entry's revision); renewals carry it."""
    region: str = ""
    """The holder's region (``LeaseRequest.region``), so a pause of it finds its leases."""
    key: str = ""
    """The idempotency key the lease was granted for (``LeaseRequest.key``), so the sink
    commits under this fence only a report of this key (empty in records from before
    this field: the sink then checks the target alone)."""
    version: str = ""
    """The id of the version tuple the lease was granted to (``LeaseRequest.versions``,
    the id the leaser computed), so the sink commits under this fence only a report
    carrying that tuple (empty in records from before this field: not checked)."""


class SealedCommit(msgspec.Struct, frozen=True, tag="committed"):
    """The job's one terminal decision is this commit, sealed before the result is
    written, carrying the result so that anyone may write it if the sealer dies."""

    fence: int
    """The fence of the holder that decided."""
    result: CommittedResult


class SealedDeath(msgspec.Struct, frozen=True, tag="dead"):
    """The job's one terminal decision is this dead letter, sealed before the letter is
    written, carrying the letter so that anyone may write it if the sealer dies."""

    fence: int
    """The fence of the holder that decided (0: the backstop, when max_deliver ran out)."""
    letter: DeadLetter


Sealed = SealedCommit | SealedDeath

QuarantineScope = Literal["worker", "identity", "egress"]
"""What a record keeps from a target: one worker, one identity (on any worker), or every
worker whose requests leave from one egress subnet (its name is the subnet)."""
AvoidScope = Literal["worker", "identity"]
"""Whom an avoid entry names: the holder's identity, or its worker id without one."""


class AvoidEntry(msgspec.Struct, frozen=True, omit_defaults=True):
    """A worker or identity the job is not granted to while the entry's marker lives: the
    target refused the job there, or the scope was quarantined while it ran there. On
    the job's ledger entry (``JobLeaseHistory.avoid``) and, as its marker, in
    ``jf-control`` with a per-key TTL of ``fleet.avoid_s``, so the NATS server's clock
    says when it lapses (docs/leases.md#the-avoid-list)."""

    scope: AvoidScope
    name: str
    reason: str = ""
    """``challenged``, ``blocked`` or ``quarantined``."""


class JobLeaseHistory(msgspec.Struct, frozen=True, omit_defaults=True):
    """Per job, in ``jf-fences``: the job's ledger entry. Which submission owns the id,
    the highest fence ever granted, how many grants, and once settled the one terminal
    decision (docs/commit.md#the-settle-rule)."""

    fence: int
    grants: int
    submit_seq: int = 0
    """The ``JF_SUBMIT`` sequence of the submission that claimed the job id at
    admission (0: claimed before claims existed, or by a grant)."""
    settled: Sealed | None = None
    """The job's terminal decision; once set no grant is recorded again."""
    routed_seq: int = 0
    """The ``JF_WORK`` sequence of the job's work order, once admission routed it (0: not
    yet marked). A redelivered submission whose claim is routed is not routed again."""
    avoid: list[AvoidEntry] = []
    """Who the job should not be granted to for a while, oldest first (at most
    ``AVOID_MAX``): an entry holds while its marker lives."""
    attempts: list[AttemptRecord] = []
    """The job's attempts that ended in a release (failed, blocked, lost, or not
    settled by the sink), oldest first, at most ``MAX_HISTORY`` (the newest), one per
    fence: what its dead letter's history is built from. Written by the leaser only."""


class Evidence(msgspec.Struct, frozen=True, omit_defaults=True):
    """One outcome event a quarantine rule counted: where to read it in ``JF_OUTCOMES``."""

    job_id: str
    seq: int
    """Its sequence in ``JF_OUTCOMES``."""
    reason: str = ""


class QuarantineRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    """A (worker or identity, target) scope that gets no grants, in ``jf-control``."""

    scope: QuarantineScope
    name: str
    target: str
    reason: str = ""
    for_s: float = 0.0
    """How long it lasts (0: until released); a duration, never a deadline (I9)."""
    set_by: str = ""
    """Who set it: ``rule:<name>`` for the quarantine service's rules, ``operator`` for
    ``jetfleet quarantine set``; empty in records from before this field."""
    evidence: list[Evidence] = []
    """The outcome events that fired the rule (at most ``quarantine.max_evidence``)."""
    subnet: str = ""
    """The subnet the retired identity's requests left from (its newest evidence's
    ``Outcome.subnet``), so a neighbour's retirement can be told second-order."""
    second_order_of: str = ""
    """The identity of the same subnet retired on the same target within
    ``quarantine.second_order_window_s`` before this one, if any: containment failed to
    stop the block from spreading to a neighbour."""
    proposed_by: str = ""
    """For an egress record an operator approved: the rule that proposed it
    (``rule:<name>``); ``set_by`` is then ``operator``."""


ProposalId = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{16}$")]
"""An egress proposal's id: 16 hex digits (``jetfleet quarantine list`` shows them)."""
ProposalState = Literal["proposed", "rejected"]


class QuarantineProposal(msgspec.Struct, frozen=True, omit_defaults=True):
    """An egress quarantine a rule proposes and an operator approves or rejects, in
    ``jf-control`` under ``quarantine-proposal.<id>`` with a per-key TTL: one nobody
    answers lapses. Approved, it becomes a ``QuarantineRecord`` of scope ``egress``."""

    id: str
    subnet: str
    target: str
    reason: str = ""
    for_s: float = 0.0
    """How long the egress record lasts once approved (0: until released)."""
    set_by: str = ""
    """The rule that proposed it: ``rule:<name>``."""
    identities: list[str] = []
    """The distinct identities of the subnet whose blocks made the proposal."""
    evidence: list[Evidence] = []
    state: ProposalState = "proposed"
    """``rejected``: an operator said no; kept (until its TTL) so it shows, and so the
    same evidence does not propose it again."""
    answered_by: str = ""
    """Who rejected it, and why (``jetfleet quarantine reject --reason``)."""


class QuarantineRetired(msgspec.Struct, frozen=True):
    """Per (target, subnet, identity), in ``jf-control``: the quarantine service retired
    the identity there, kept for ``quarantine.second_order_window_s`` by the server's
    per-key TTL, so a neighbour retired after it counts as second-order."""

    identity: str
    subnet: str


class QuarantineFired(msgspec.Struct, frozen=True):
    """Per (rule, scope, target), in ``jf-control``: the newest ``JF_OUTCOMES`` sequence
    that fired the rule there, so the same evidence never sets a record twice."""

    seq: int


class QuarantineSet(msgspec.Struct, frozen=True, tag="set", omit_defaults=True):
    """Quarantine a scope on a target: no more grants, held leases revoked and requeued."""

    record: QuarantineRecord
    by: ShortText = ""
    """Who asked (``jetfleet ... --as NAME``, else the OS user), for the audit log."""
    why: ShortText = ""
    """Why (``--why``), for the audit log."""


class QuarantineRelease(msgspec.Struct, frozen=True, tag="release"):
    """Lift a quarantine."""

    scope: QuarantineScope
    name: RequiredName
    target: TargetName
    by: ShortText = ""
    """Who asked (``jetfleet ... --as NAME``, else the OS user), for the audit log."""
    why: ShortText = ""
    """Why (``--why``), for the audit log."""


class QuarantineList(msgspec.Struct, frozen=True, tag="list"):
    """List quarantine records."""


class QuarantineApprove(msgspec.Struct, frozen=True, tag="approve"):
    """Approve an egress proposal: it becomes an egress record in force (the subnet's
    held leases on the target revoked and requeued) and the proposal goes."""

    id: ProposalId
    by: ShortText = ""
    """Who asked (``jetfleet ... --as NAME``, else the OS user), for the audit log."""
    why: ShortText = ""
    """Why (``--why``), for the audit log."""


class QuarantineReject(msgspec.Struct, frozen=True, tag="reject", omit_defaults=True):
    """Reject an egress proposal: no record; it stays, rejected, until its TTL."""

    id: ProposalId
    reason: ShortText = ""
    by: ShortText = ""
    """Who asked (``jetfleet ... --as NAME``, else the OS user), for the audit log."""
    why: ShortText = ""
    """Why (``--why``), for the audit log."""


QuarantineCommand = (
    QuarantineSet | QuarantineRelease | QuarantineList | QuarantineApprove | QuarantineReject
)


class QuarantineReply(msgspec.Struct, frozen=True, omit_defaults=True):
    """The leaser's answer to a quarantine command."""

    ok: bool
    records: list[QuarantineRecord] = []
    revoked: list[str] = []
    """Job ids whose leases were revoked and requeued at once."""
    detail: str = ""
    proposals: list[QuarantineProposal] = []
    """The egress proposal an approve or reject answered."""
    retry_after_s: float = 0.0
    """With ``ok`` false: the leaser did not finish the command (it was full, or
    JetStream did not answer it in time), so nothing is known to be wrong with it: send
    the same command again after this many seconds. 0 with ``ok`` false: refused, final
    (``detail`` says what to fix)."""
