"""What a worker tells the sink at the end of an attempt, and what the sink answers.

Carried on ``jf.sink.report.<target>`` (request/reply, queue group ``sink``).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from jetfleet.schemas.job import WorkOrder
from jetfleet.schemas.names import Name, RequiredName
from jetfleet.schemas.output import HandlerOutput


class Versions(msgspec.Struct, frozen=True, omit_defaults=True):
    """The version tuple a result was produced with (I8; docs/versions.md).

    Built once per worker from what is installed and configured, never typed by hand
    (jetfleet/version_tuple.py); only ``handler`` changes per job. ``id`` names the
    tuple without ``handler``: what the approved set lists.
    """

    jetfleet: str
    handler: str = ""
    browser: str = ""
    """The browser's version once a browser handler exists (empty until then)."""
    code: str = ""
    """The code revision: the package version, plus ``+g<commit>`` when a commit is known
    (and ``.dirty`` for a tree with uncommitted changes)."""
    config: str = ""
    """A short sha256 of the effective behavioural settings (targets, fleet, worker
    behaviour, quarantine): alike for every worker of one deployment."""
    python: str = ""
    nats_py: str = ""
    declared: dict[str, str] = {}
    """Operator-declared fields (``worker.version_fields``)."""
    unpinned: bool = False
    """True: started from an unpinned environment (editable install, a source tree with
    uncommitted changes, a local or dev version); ``unpinned_why`` says which."""
    unpinned_why: str = ""
    id: str = ""
    """The tuple id the worker computed (the leaser computes it again from the fields)."""


class AttemptRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    """One attempt in a job's history."""

    attempt: int
    worker: str
    identity: str = ""
    fence: int = 0
    duration_s: float = 0.0
    outcome: str = ""
    reason: str = ""


class Success(msgspec.Struct, frozen=True, tag="success", omit_defaults=True):
    """The handler succeeded: commit ``output`` unless this unit of work is done already."""

    order: WorkOrder
    worker: RequiredName
    attempt: int
    duration_s: float
    output: HandlerOutput
    versions: Versions
    identity: Name = ""
    fence: int = 0


MAX_REPORTED_ATTEMPTS = 1000
"""The most attempts a failure report may list; a worker lists its own last one."""
FailureReason = Annotated[str, msgspec.Meta(max_length=1024, pattern=r"^[^\x00-\x1f\x7f]*$")]
"""Why a job failed (``attempts-exhausted``, ``http-404``, a user handler's own): a dead
letter's ``Jf-Reason`` header, so no line breaks; at most 1024 characters."""


class Failure(msgspec.Struct, frozen=True, tag="failure", omit_defaults=True):
    """The job cannot succeed (permanent, or attempts exhausted): dead-letter it."""

    order: WorkOrder
    worker: RequiredName
    reason: FailureReason
    history: Annotated[list[AttemptRecord], msgspec.Meta(max_length=MAX_REPORTED_ATTEMPTS)]
    versions: Versions
    detail: str = ""
    identity: Name = ""
    fence: int = 0


MAX_DECODE_ERROR_CHARS = 1024
"""The longest decode error a ``Malformed`` report carries (msgspec's are one line)."""
WorkSubject = Annotated[str, msgspec.Meta(max_length=256, pattern=r"^jf\.work\.[^\s*>]+$")]
"""A work subject, ``jf.work.<target>.<tier>``: no spaces or wildcards."""


class Malformed(msgspec.Struct, frozen=True, tag="malformed", omit_defaults=True):
    """A delivered work order that does not decode: the sink keeps it on
    ``jf.rejected.<target>`` (reason ``malformed-work-order``) and answers
    ``kept:malformed-work-order``, then the worker terminates the delivery.

    No lease: nothing ran. The sink trusts none of it but where to look: it reads the
    message at ``stream_seq`` from ``JF_WORK`` itself, keeps it only if it is on
    ``subject`` and does not decode there either, and keeps the stored bytes, never
    ``raw`` (docs/dead-letters.md#malformed-work-orders)."""

    worker: RequiredName
    subject: WorkSubject
    """The delivery's subject, ``jf.work.<target>.<tier>``."""
    stream_seq: Annotated[int, msgspec.Meta(ge=1)]
    """The message's sequence in ``JF_WORK``."""
    error: Annotated[str, msgspec.Meta(max_length=MAX_DECODE_ERROR_CHARS)]
    """Why the worker could not decode it."""
    raw: bytes = b""
    """The first bytes of the order as delivered (at most ``fleet.max_job_bytes``, and
    what fits the server's max_payload): for the sink's check that it reads the same
    message; the record keeps the stored bytes."""
    raw_size: int = 0
    """The delivered order's whole size."""


Report = Success | Failure | Malformed

SinkStatus = Literal[
    "committed",
    "suppressed:duplicate-key",
    "rejected:fenced-out",
    "rejected:lease-expired",
    "rejected:not-granted",
    "dead-lettered",
    "error",
    "busy",
    "kept:malformed-work-order",
]


class SinkReply(msgspec.Struct, frozen=True, omit_defaults=True):
    """The sink's verdict; the worker acks after committed/suppressed, terms after
    dead-lettered or kept:malformed-work-order (the answer to a ``Malformed`` report),
    and leaves the message alone otherwise."""

    status: SinkStatus
    detail: str = ""
    committed_by: str = ""
    """With ``suppressed:duplicate-key``: the job id whose commit holds the key."""
    retry_after_s: float = 0.0
    """With ``busy``: how long to wait before sending the same report again. Busy means
    not settled: the replica had ``fleet.service_concurrency`` reports in hand and did not
    look at this one, JetStream did not answer it in time, or the replica does not
    declare the report's target (its settings lag the leaser's)."""
