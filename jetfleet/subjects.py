"""Every subject, stream, consumer and bucket name jetfleet uses, in one place.

Subjects are ``jf.<family>.<target>[.<tier>]``: one subject family per target, so one
target's backlog or ban cannot stall another (docs/architecture.md).
"""

from __future__ import annotations

import re

PREFIX = "jf"

# Streams.
STREAM_SUBMIT = "JF_SUBMIT"
STREAM_WORK = "JF_WORK"
STREAM_RESULTS = "JF_RESULTS"
STREAM_DLQ = "JF_DLQ"
STREAM_REJECTED = "JF_REJECTED"
STREAM_OUTCOMES = "JF_OUTCOMES"
STREAM_DUPLICATES = "JF_DUPLICATES"
STREAM_ALERTS = "JF_ALERTS"  # circuit breaker openings and closings, for operators
# The server's max-deliveries advisories for JF_WORK, kept until the sink has ended the job
# (a core NATS advisory is lost when nobody listens).
STREAM_ADVISORIES = "JF_ADVISORIES"
STREAM_AUDIT = "JF_AUDIT"  # every control action: who, what, why (docs/audit.md)

# KV buckets.
BUCKET_LEASES = "jf-leases"  # job id -> live lease (fence = revision); used by the leaser
BUCKET_FENCES = "jf-fences"  # job id -> id claim, highest fence, grant count, seal
BUCKET_CONTROL = "jf-control"  # pause switches, quarantine records, approved versions
BUCKET_WORKERS = "jf-workers"  # what workers say: identities owned, last hand-backs (TTLs)
BUCKET_TARGETS = "jf-targets"  # target -> limits set at run time (jetfleet target set)
BUCKET_ROBOTS = "jf-robots"  # target -> its robots.txt as fetched (max age: the cache TTL)
# In jf-control: which outcome event last fired a quarantine rule (per rule, scope, target).
QUARANTINE_FIRED_PREFIX = "quarantine-fired"
QUARANTINE_PROPOSAL_PREFIX = "quarantine-proposal"  # egress proposals awaiting an operator
QUARANTINE_RETIRED_PREFIX = "quarantine-retired"  # recent retirements, for second-order counts
AVOID_PREFIX = "avoid"  # jf-control: a job's avoid entries in force (per-key TTL)
# In jf-control, per target: its circuit breaker's record (no TTL), its cooling (per-key
# TTL: open while it lives), its one probe (the probe lease's TTL) and the newest outcome
# event that opened it (so a replay does not open it again).
BREAKER_PREFIX = "breaker"
BREAKER_COOL_PREFIX = "breaker-cool"
BREAKER_PROBE_PREFIX = "breaker-probe"
BREAKER_FIRED_PREFIX = "breaker-fired"
# In jf-control, per version tuple id (docs/versions.md): its approval (no TTL), its
# withdrawal (why), and its last sighting by a leaser (per-key TTL); and the rollout
# guard's fleet-wide switch.
VERSION_APPROVED_PREFIX = "version-approved"
VERSION_WITHDRAWN_PREFIX = "version-withdrawn"
VERSION_SEEN_PREFIX = "version-seen"
VERSION_GUARD_KEY = "version-guard"

# Object store buckets.
OBJECTS_RESULTS = "jf-result-objects"  # bodies (later screenshots) too large for a message

# Consumers.
CONSUMER_SCHEDULER = "scheduler"
CONSUMER_MAX_DELIVERIES = "max-deliveries"  # on JF_ADVISORIES, read by the sink

# Request/reply subjects (served by queue groups).
SINK_REPORT = f"{PREFIX}.sink.report"  # + .<target>
QUEUE_SINK = "sink"
LEASE = f"{PREFIX}.lease"
QUARANTINE = f"{PREFIX}.quarantine"  # operator commands, served by the leaser
# Egress proposal answers only (approve, reject), served by the leaser: the gateway's
# dashboard may send these and nothing else of the quarantine commands.
QUARANTINE_ANSWER = f"{PREFIX}.quarantine-answer"
QUEUE_LEASER = "leaser"
BREAKER = f"{PREFIX}.breaker"  # circuit breaker commands, served by the leaser
VERSIONS = f"{PREFIX}.versions"  # approved version commands, served by the leaser
RATELIMIT = f"{PREFIX}.ratelimit"  # permits and holds, served by the ratelimit service
QUEUE_RATELIMIT = "ratelimit"

TIERS = ("high", "normal", "bulk")
DEFAULT_TIER = "normal"

# A target name is a single subject token and part of consumer names.
TARGET_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
# What a rejected submission is filed under when its subject names no usable token.
UNPARSABLE_TARGET = "_invalid"


AUDIT = f"{PREFIX}.audit"  # + .<action>, e.g. jf.audit.quarantine.set


def audit(action: str) -> str:
    """Where an audit entry of ``action`` (dotted tokens) is published."""
    return f"{AUDIT}.{action}"


def max_deliveries_advisories(stream: str) -> str:
    """The server's advisories for ``stream``'s messages whose max_deliver ran out."""
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.>"


def alert(target: str) -> str:
    """Where ``target``'s circuit breaker alerts are published (kept in JF_ALERTS)."""
    return f"{PREFIX}.alert.{target}"


# On jf.alert.<token>: a target name cannot start with "_", so this one is nobody's.
VERSIONS_ALERT = f"{PREFIX}.alert._versions"


def submit(target: str) -> str:
    """The subject a client publishes a job for ``target`` to."""
    return f"{PREFIX}.submit.{target}"


def work(target: str, tier: str) -> str:
    """The work subject of ``target`` at priority ``tier``."""
    return f"{PREFIX}.work.{target}.{tier}"


def work_filter(target: str, tier: str | None = None) -> str:
    """The filter matching ``target``'s work of one tier (or of every tier)."""
    return f"{PREFIX}.work.{target}.{tier}" if tier else f"{PREFIX}.work.{target}.>"


def results(target: str) -> str:
    """The filter matching every committed result of ``target``."""
    return f"{PREFIX}.results.{target}.>"


def result_key(target: str, key: str) -> str:
    """The subject of the one committed result for idempotency ``key``: the record is
    also the key, written put-if-absent, so result and key can never disagree."""
    return f"{PREFIX}.results.{target}.{key}"


def duplicates(target: str) -> str:
    """Where jobs settled by another job's commit of the same work are recorded."""
    return f"{PREFIX}.duplicates.{target}"


def dlq(target: str) -> str:
    """The filter matching every dead letter of ``target``."""
    return f"{PREFIX}.dlq.{target}.>"


def dead_letter(target: str, job_id: str) -> str:
    """The subject of one job's dead letter: one per job, so whether a job is dead is one
    direct read (the leaser refuses to run a dead-lettered job again)."""
    return f"{PREFIX}.dlq.{target}.{job_id}"


def rejected(target: str) -> str:
    """Where rejected submissions are kept, filed under their (possibly unknown) target."""
    return f"{PREFIX}.rejected.{target}"


def outcomes(target: str) -> str:
    """Where the outcome events of ``target``'s jobs are published, the job id in the
    ``Jf-Job`` header: one subject per target, so the server keeps no per-job index
    entry for them (docs/scale.md#subject-state). ``outcome_filters`` reads a target."""
    return f"{PREFIX}.outcome.{target}"


def outcome(target: str, job_id: str) -> str:
    """The per-job subject outcome events were published on before ``outcomes``: such
    events live until ``fleet.retention_s`` ends, and readers still take them."""
    return f"{PREFIX}.outcome.{target}.{job_id}"


def outcome_filters(target: str) -> list[str]:
    """The filters matching every outcome event of ``target``, of either subject form."""
    return [outcomes(target), f"{outcomes(target)}.>"]


def sink_report(target: str) -> str:
    """The request subject a worker reports an attempt's end to the sink on."""
    return f"{SINK_REPORT}.{target}"


def work_consumer(target: str, tier: str = DEFAULT_TIER) -> str:
    """The durable pull consumer of one tier of ``target``, shared by every worker
    assigned to the target (non-overlapping filters, as a WorkQueue stream requires)."""
    return f"work-{target}-{tier}"


def target_of(subject: str) -> str:
    """The target token of a ``jf.<family>.<target>...`` subject, or UNPARSABLE_TARGET."""
    parts = subject.split(".")
    if len(parts) >= 3 and TARGET_NAME_RE.match(parts[2]):
        return parts[2]
    return UNPARSABLE_TARGET


# Presence writes (identity claims, region presence, hand-back notes, robots.txt records)
# made by the leaser for workers, which have no KV rights (schemas/presence.py).
PRESENCE = f"{PREFIX}.presence"

# The pause switch (docs/pause.md): commands served by the leaser, and the records in
# jf-control under pause.<scope>.<name> (a per-key TTL when timed).
PAUSE = f"{PREFIX}.pause"
PAUSE_PREFIX = "pause"
