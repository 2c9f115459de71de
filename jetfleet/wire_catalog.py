"""The catalogue of subjects and what they carry: one ``Channel`` per subject family.

This is the single list ``jetfleet schemas export`` renders the JSON Schema and AsyncAPI
documents from, so a subject that is not listed here has no published contract.
Addresses are the subject helpers of ``jetfleet.subjects`` called with ``{parameter}``
placeholders, so the catalogue cannot drift from the names the code publishes to.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from types import UnionType
from typing import Literal

import msgspec

from jetfleet import subjects
from jetfleet.schemas import (
    CommittedResult,
    DeadLetter,
    Duplicate,
    Job,
    LeaseReply,
    Outcome,
    OutcomeBatch,
    Rejection,
    Report,
    SinkReply,
    WorkOrder,
)
from jetfleet.schemas.audit import AuditEntry
from jetfleet.schemas.breaker import (
    BreakerAlert,
    BreakerCommand,
    BreakerProbe,
    BreakerRecord,
    BreakerReply,
)
from jetfleet.schemas.control import PauseCommand, PauseRecord, PauseReply
from jetfleet.schemas.lease import (
    AvoidEntry,
    JobLeaseHistory,
    LeaseCall,
    LeaseRecord,
    QuarantineApprove,
    QuarantineCommand,
    QuarantineFired,
    QuarantineProposal,
    QuarantineRecord,
    QuarantineReject,
    QuarantineReply,
    QuarantineRetired,
)
from jetfleet.schemas.permit import PermitCall, RatelimitReply
from jetfleet.schemas.presence import PresenceReply, PresenceWrite
from jetfleet.schemas.targets import RobotsRecord, TargetLimits
from jetfleet.schemas.versions import (
    VersionAlert,
    VersionApproval,
    VersionsCommand,
    VersionSighting,
    VersionsReply,
    VersionWithdrawal,
)

ChannelKind = Literal["stream", "request", "reply", "kv"]
Payload = type[msgspec.Struct] | UnionType
"""A Struct type, or a tagged union of Struct types."""

LEASE_ADDRESS = subjects.LEASE
QUEUE_LEASER = subjects.QUEUE_LEASER

# A reply goes to the requester's inbox, which the requester picks per request.
DYNAMIC_ADDRESS = ""

_TARGET = "{target}"
_TIER = "{tier}"


@dataclass(frozen=True)
class Channel:
    """One subject family and the payload it carries.

    Attributes:
        name: Stable short name; also the JSON Schema file name (``json/<name>.schema.json``).
        address: The subject with ``{target}``/``{tier}`` placeholders, or
            ``DYNAMIC_ADDRESS`` for replies (they go to the requester's inbox).
        kind: ``stream`` (kept in a JetStream stream), ``request`` (core request/reply,
            served by a queue group), ``reply`` (the answer to a request) or ``kv``.
        payload: The Struct type or tagged union every message on it decodes to.
        description: What the channel is for, who sends and who receives.
        stream: The JetStream stream holding the subject (``stream`` kind only).
        consumer: The durable consumer reading it, with placeholders, if there is one.
        queue_group: The queue group serving it (``request`` kind only).
        reply: The name of the channel answers come back on (``request`` kind only).
    """

    name: str
    address: str
    kind: ChannelKind
    payload: Payload
    description: str
    stream: str = ""
    consumer: str = ""
    queue_group: str = ""
    reply: str = ""

    @property
    def members(self) -> tuple[type[msgspec.Struct], ...]:
        """The Struct types the payload may be: one for a plain Struct, each union member."""
        return payload_members(self.payload)

    @property
    def parameters(self) -> tuple[str, ...]:
        """The placeholder names in ``address``, in order (e.g. ``("target", "tier")``)."""
        return tuple(part[1:-1] for part in self.address.split(".") if part.startswith("{"))


def payload_members(payload: Payload) -> tuple[type[msgspec.Struct], ...]:
    """Flatten a payload into the Struct types it may decode to.

    Args:
        payload: A Struct type or a union of Struct types.

    Returns:
        The Struct types, in declaration order.
    """
    if isinstance(payload, UnionType):
        return tuple(typing.get_args(payload))
    return (payload,)


CHANNELS: tuple[Channel, ...] = (
    Channel(
        name="submit",
        address=subjects.submit(_TARGET),
        kind="stream",
        payload=Job,
        description="Clients publish jobs for a target; the scheduler admits or rejects them.",
        stream=subjects.STREAM_SUBMIT,
        consumer=subjects.CONSUMER_SCHEDULER,
    ),
    Channel(
        name="work",
        address=subjects.work(_TARGET, _TIER),
        kind="stream",
        payload=WorkOrder,
        description=(
            "The scheduler routes admitted jobs here by target and priority tier; the "
            "workers assigned to a target share one durable pull consumer (WorkQueue "
            "retention, so each order is delivered to one worker at a time)."
        ),
        stream=subjects.STREAM_WORK,
        consumer=subjects.work_consumer(_TARGET, _TIER),
    ),
    Channel(
        name="sink-report",
        address=subjects.sink_report(_TARGET),
        kind="request",
        payload=Report,
        description=(
            "A worker reports the end of an attempt (success to commit, or failure to "
            "dead-letter) to the sink, which checks fence, lease and idempotency key."
        ),
        queue_group=subjects.QUEUE_SINK,
        reply="sink-reply",
    ),
    Channel(
        name="sink-reply",
        address=DYNAMIC_ADDRESS,
        kind="reply",
        payload=SinkReply,
        description="The sink's verdict on a report; it tells the worker whether to ack.",
    ),
    Channel(
        name="results",
        address=subjects.result_key(_TARGET, "{key}"),
        kind="stream",
        payload=CommittedResult,
        description=(
            "The sink writes each committed result here, put-if-absent on the subject of "
            "its idempotency key: the record is the key, one per unit of work."
        ),
        stream=subjects.STREAM_RESULTS,
    ),
    Channel(
        name="duplicates",
        address=subjects.duplicates(_TARGET),
        kind="stream",
        payload=Duplicate,
        description=(
            "A job settled by another job's commit of the same unit of work (the leaser "
            "said already-done, or the sink suppressed its commit): committed, no second "
            "side effect."
        ),
        stream=subjects.STREAM_DUPLICATES,
    ),
    Channel(
        name="dlq",
        address=subjects.dead_letter(_TARGET, "{job_id}"),
        kind="stream",
        payload=DeadLetter,
        description="Jobs that will not be retried, with the reason and attempt history.",
        stream=subjects.STREAM_DLQ,
    ),
    Channel(
        name="rejected",
        address=subjects.rejected(_TARGET),
        kind="stream",
        payload=Rejection,
        description=(
            "Submissions the scheduler refused at admission, kept with their raw bytes "
            "and the reason, filed under their target (or "
            f"{subjects.UNPARSABLE_TARGET!r} when the subject names no usable target)."
        ),
        stream=subjects.STREAM_REJECTED,
    ),
    Channel(
        name="outcome",
        address=subjects.outcomes(_TARGET),
        kind="stream",
        payload=Outcome,
        description=(
            "One event per attempt's outcome, the job id in the Jf-Job header, read by "
            "quarantine, the gateway's tail and doctor (events from before this subject "
            "are on jf.outcome.{target}.{job_id} until their retention ends). A worker's "
            "ok events come in batches on the same subject (outcome-batch)."
        ),
        stream=subjects.STREAM_OUTCOMES,
    ),
    Channel(
        name="outcome-batch",
        address=subjects.outcomes(_TARGET),
        kind="stream",
        payload=OutcomeBatch,
        description=(
            "A worker's ok outcome events of one target, 1 to 64 to a message, with the "
            "Jf-Batch header (their count) and no Jf-Job; failures are never batched. "
            "Read by the same readers as outcome."
        ),
        stream=subjects.STREAM_OUTCOMES,
    ),
    Channel(
        name="lease",
        address=LEASE_ADDRESS,
        kind="request",
        payload=LeaseCall,
        description="Workers ask the leaser to grant, renew or release a job's lease.",
        queue_group=QUEUE_LEASER,
        reply="lease-reply",
    ),
    Channel(
        name="lease-reply",
        address=DYNAMIC_ADDRESS,
        kind="reply",
        payload=LeaseReply,
        description="The leaser's answer: granted (fence, ttl_s), refused, or already done.",
    ),
    Channel(
        name="quarantine",
        address=subjects.QUARANTINE,
        kind="request",
        payload=QuarantineCommand,
        description=(
            "Operators set, release or list quarantines of a (worker, identity or egress "
            "subnet, target) scope, and approve or reject egress proposals; setting one "
            "revokes its live leases and requeues their jobs at once."
        ),
        queue_group=QUEUE_LEASER,
        reply="quarantine-reply",
    ),
    Channel(
        name="quarantine-reply",
        address=DYNAMIC_ADDRESS,
        kind="reply",
        payload=QuarantineReply,
        description="The leaser's answer to a quarantine command.",
    ),
    Channel(
        name="quarantine-answer",
        address=subjects.QUARANTINE_ANSWER,
        kind="request",
        payload=QuarantineApprove | QuarantineReject,
        description=(
            "The gateway's dashboard approves or rejects an egress proposal: the only "
            "quarantine commands it may send (no set, release or list)."
        ),
        queue_group=QUEUE_LEASER,
        reply="quarantine-reply",
    ),
    Channel(
        name="leases",
        address=f"$KV.{subjects.BUCKET_LEASES}.{{job_id}}",
        kind="kv",
        payload=LeaseRecord,
        description=(
            "The live lease of a job, with a per-key TTL judged by the server's clock; "
            "its fence is the revision of the grant."
        ),
    ),
    Channel(
        name="fences",
        address=f"$KV.{subjects.BUCKET_FENCES}.{{job_id}}",
        kind="kv",
        payload=JobLeaseHistory,
        description=(
            "Per job: the submission that claimed its id, the highest fence ever granted, "
            "the number of grants and, once settled, its one terminal decision (the seal)."
        ),
    ),
    Channel(
        name="ratelimit",
        address=subjects.RATELIMIT,
        kind="request",
        payload=PermitCall,
        description=(
            "A worker asks for a rate permit just before each request it sends (a job's "
            "first, each redirect hop, a robots.txt fetch), and the leaser for the grant "
            "of a worker from before that (sends_request true); a worker asks to hold a "
            "target that answered 429 or 503 for the whole fleet."
        ),
        queue_group=subjects.QUEUE_RATELIMIT,
        reply="ratelimit-reply",
    ),
    Channel(
        name="ratelimit-reply",
        address=DYNAMIC_ADDRESS,
        kind="reply",
        payload=RatelimitReply,
        description="allowed, wait (retry_after_s and the limit), held, or refused.",
    ),
    Channel(
        name="target-limits",
        address=f"$KV.{subjects.BUCKET_TARGETS}.{{target}}",
        kind="kv",
        payload=TargetLimits,
        description="A target's rate, burst and daily budget set at run time.",
    ),
    Channel(
        name="robots",
        address=f"$KV.{subjects.BUCKET_ROBOTS}.{{target}}",
        kind="kv",
        payload=RobotsRecord,
        description="A target's robots.txt as last fetched (kept for fleet.robots_ttl_s).",
    ),
    Channel(
        name="quarantine-records",
        address=f"$KV.{subjects.BUCKET_CONTROL}.quarantine.{{target}}.{{scope}}.{{name}}",
        kind="kv",
        payload=QuarantineRecord,
        description="A quarantine in force (optionally with a server-side TTL).",
    ),
    Channel(
        name="quarantine-fired",
        address=f"$KV.{subjects.BUCKET_CONTROL}.{subjects.QUARANTINE_FIRED_PREFIX}"
        ".{target}.{rule}.{scope_hash}",
        kind="kv",
        payload=QuarantineFired,
        description="The newest outcome event that fired a quarantine rule for one scope "
        "on one target, kept past the longest rule window (docs/quarantine.md).",
    ),
    Channel(
        name="quarantine-proposals",
        address=f"$KV.{subjects.BUCKET_CONTROL}.{subjects.QUARANTINE_PROPOSAL_PREFIX}.{{id}}",
        kind="kv",
        payload=QuarantineProposal,
        description="An egress quarantine a rule proposes for an operator to approve or "
        "reject, with a per-key TTL: one nobody answers lapses (docs/quarantine.md).",
    ),
    Channel(
        name="quarantine-retired",
        address=f"$KV.{subjects.BUCKET_CONTROL}.{subjects.QUARANTINE_RETIRED_PREFIX}"
        ".{target}.{subnet_hash}.{identity_hash}",
        kind="kv",
        payload=QuarantineRetired,
        description="A retirement the quarantine service set, kept for "
        "quarantine.second_order_window_s, so a neighbour's counts as second-order.",
    ),
    Channel(
        name="avoid-markers",
        address=f"$KV.{subjects.BUCKET_CONTROL}.{subjects.AVOID_PREFIX}.{{digest}}",
        kind="kv",
        payload=AvoidEntry,
        description="One entry of a job's avoid list in force: a per-key TTL of "
        "fleet.avoid_s, so the server's clock says when it lapses (docs/leases.md).",
    ),
    Channel(
        name="breaker",
        address=subjects.BREAKER,
        kind="request",
        payload=BreakerCommand,
        description=(
            "The quarantine service (and operators) open, close or list a target's "
            "circuit breaker; opening one revokes the target's live leases and requeues "
            "their jobs at once."
        ),
        queue_group=QUEUE_LEASER,
        reply="breaker-reply",
    ),
    Channel(
        name="breaker-reply",
        address=DYNAMIC_ADDRESS,
        kind="reply",
        payload=BreakerReply,
        description="The leaser's answer to a breaker command.",
    ),
    Channel(
        name="alert",
        address=subjects.alert(_TARGET),
        kind="stream",
        payload=BreakerAlert,
        description="A target's circuit breaker opened, re-opened or closed.",
        stream=subjects.STREAM_ALERTS,
    ),
    Channel(
        name="breaker-records",
        address=f"$KV.{subjects.BUCKET_CONTROL}.{subjects.BREAKER_PREFIX}.{{target}}",
        kind="kv",
        payload=BreakerRecord,
        description="A target's circuit breaker, open or half-open, until it is closed.",
    ),
    Channel(
        name="breaker-probe",
        address=f"$KV.{subjects.BUCKET_CONTROL}.{subjects.BREAKER_PROBE_PREFIX}.{{target}}",
        kind="kv",
        payload=BreakerProbe,
        description="The one probe lease of a half-open breaker, with the lease's TTL.",
    ),
    Channel(
        name="presence",
        address=subjects.PRESENCE,
        kind="request",
        payload=PresenceWrite,
        description=(
            "A worker (which has no KV rights) asks the leaser to write its presence: its "
            "identity claim (create, compare-and-set update and delete of owned.<digest> "
            "in jf-workers), its region (put of region.<digest>), a last hand-back note "
            "(put of handback.<job id>) or a robots.txt record (put of <target> in "
            "jf-robots), each with its per-key TTL. Anything else is refused not-permitted."
        ),
        queue_group=QUEUE_LEASER,
        reply="presence-reply",
    ),
    Channel(
        name="presence-reply",
        address=DYNAMIC_ADDRESS,
        kind="reply",
        payload=PresenceReply,
        description=(
            "written (the key's new revision), or refused: wrong-revision (a "
            "compare-and-set lost), not-permitted, busy (retry_after_s), failed."
        ),
    ),
    Channel(
        name="pause",
        address=subjects.PAUSE,
        kind="request",
        payload=PauseCommand,
        description=(
            "Operators pause or resume the fleet, a target, a region, a worker or an "
            "identity (or list the pauses): no lease is granted in scope, and a fleet or "
            "target pause also pauses the work consumers at the server (docs/pause.md)."
        ),
        queue_group=QUEUE_LEASER,
        reply="pause-reply",
    ),
    Channel(
        name="pause-reply",
        address=DYNAMIC_ADDRESS,
        kind="reply",
        payload=PauseReply,
        description="The leaser's answer to a pause command, once it refuses in scope.",
    ),
    Channel(
        name="pause-records",
        address=f"$KV.{subjects.BUCKET_CONTROL}.{subjects.PAUSE_PREFIX}.{{scope}}.{{name}}",
        kind="kv",
        payload=PauseRecord,
        description="A pause in force; a timed one has the per-key TTL for_s, so it "
        "lapses by the server's clock.",
    ),
    Channel(
        name="versions",
        address=subjects.VERSIONS,
        kind="request",
        payload=VersionsCommand,
        description="Operators (and the rollout guard, for a revoke) list, approve or "
        "revoke version tuples, or turn the rollout guard on or off (docs/versions.md).",
        queue_group=QUEUE_LEASER,
        reply="versions-reply",
    ),
    Channel(
        name="versions-reply",
        address=DYNAMIC_ADDRESS,
        kind="reply",
        payload=VersionsReply,
        description="The leaser's answer to a versions command.",
    ),
    Channel(
        name="versions-alert",
        address=subjects.VERSIONS_ALERT,
        kind="stream",
        payload=VersionAlert,
        description="A version tuple was withdrawn from the approved set (by the rollout "
        "guard or an operator).",
        stream=subjects.STREAM_ALERTS,
    ),
    Channel(
        name="version-approved",
        address=f"$KV.{subjects.BUCKET_CONTROL}.{subjects.VERSION_APPROVED_PREFIX}.{{id}}",
        kind="kv",
        payload=VersionApproval,
        description="An approved version tuple (no TTL); when it was approved is the "
        "entry's stored timestamp.",
    ),
    Channel(
        name="version-withdrawn",
        address=f"$KV.{subjects.BUCKET_CONTROL}.{subjects.VERSION_WITHDRAWN_PREFIX}.{{id}}",
        kind="kv",
        payload=VersionWithdrawal,
        description="Why a version tuple left the approved set, and by whom.",
    ),
    Channel(
        name="version-seen",
        address=f"$KV.{subjects.BUCKET_CONTROL}.{subjects.VERSION_SEEN_PREFIX}.{{id}}",
        kind="kv",
        payload=VersionSighting,
        description="A tuple a leaser was asked with, per-key TTL a day, written at most "
        "once per tuple per replica every 5 minutes.",
    ),
    Channel(
        name="audit",
        address=subjects.audit("{action}"),
        kind="stream",
        payload=AuditEntry,
        description="One control action (who, what, why, outcome), recorded by the service "
        "or CLI that executed it; its time is the message's server timestamp.",
        stream=subjects.STREAM_AUDIT,
    ),
)


def by_name(name: str) -> Channel:
    """Look up a channel by its name.

    Args:
        name: A channel name, e.g. ``"submit"``.

    Returns:
        The channel.

    Raises:
        KeyError: No channel has that name.
    """
    for channel in CHANNELS:
        if channel.name == name:
            return channel
    raise KeyError(name)
