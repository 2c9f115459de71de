"""Who may do what: every role's NATS publish/subscribe lists, in one table.

The table is the one source of truth: ``jetfleet auth init`` writes the nats-server
``authorization {}`` block from it, ``docs/security.md`` is checked against it by a test,
and the whole test suite runs each service under its own role, so a subject a service
uses but its role lacks fails the tests (the server refuses it; see connection.py).

What each list allows was read from the code (every ``js.``/KV/object store/publish/
request/subscribe call) and from the server's ``trace: true`` log of the test suite.
JetStream calls are plain subjects to the server:

- a stream publish is a publish on the stream's subject (``jf.results.<target>.<key>``);
- KV put/create/update/delete publish on ``$KV.<bucket>.<key>``; a KV get is
  ``$JS.API.DIRECT.GET.KV_<bucket>.>`` or ``$JS.API.STREAM.MSG.GET.KV_<bucket>``; a watch
  or ``keys()`` creates an ordered consumer (``$JS.API.CONSUMER.CREATE.KV_<bucket>``);
- a pull fetch is ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>``; ack, nak, +WPI and
  term publish on the delivery's reply subject ``$JS.ACK.<stream>.<consumer>.>``.

Replies to requests a role serves go out under ``allow_responses`` (only to the reply
subject of a request it received), so no service may publish on another's inbox.
Inboxes are per role (``_INBOX_<role>.<connection>.``, connection.py), and a role may
subscribe only to its own inbox family: a worker cannot read a service's replies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jetfleet import subjects

Role = Literal[
    "admin",
    "operator",
    "client",
    "scheduler",
    "leaser",
    "ratelimit",
    "quarantine",
    "sink",
    "gateway",
    "worker",
]

ROLE_NAMES: tuple[Role, ...] = (
    "admin",
    "operator",
    "client",
    "scheduler",
    "leaser",
    "ratelimit",
    "quarantine",
    "sink",
    "gateway",
    "worker",
)

# Subjects other parts of issue #11 add; the roles that need them hold them already.
VERSIONS = f"{subjects.PREFIX}.versions"  # operator -> leaser: list, approve, revoke tuples
PAUSE = f"{subjects.PREFIX}.pause"  # operator -> leaser: pause and resume scopes
PRESENCE = f"{subjects.PREFIX}.presence"  # worker -> leaser: the worker's own KV records
AUDIT = f"{subjects.PREFIX}.audit.>"  # control actions, kept in stream JF_AUDIT
# Written by the leaser (the commands it serves, the quarantine service's and the rollout
# guard's included) and the operator's CLI (its own actions) only, but for the gateway's
# dlq.replay entries (AUDIT_REPLAY): another role holding it could forge an entry of the
# log operators trust.
STREAM_AUDIT = "JF_AUDIT"
AUDIT_REPLAY = f"{subjects.PREFIX}.audit.dlq.replay"  # the gateway's one audit action

_API = "$JS.API"


def inbox_family(role: Role) -> str:
    """The inbox prefix of every connection of ``role`` (one token, no dots)."""
    return f"_INBOX_{role}"


def _kv_read(bucket: str) -> tuple[str, ...]:
    stream = f"KV_{bucket}"
    return (
        f"{_API}.STREAM.INFO.{stream}",
        f"{_API}.STREAM.MSG.GET.{stream}",
        f"{_API}.DIRECT.GET.{stream}",
        f"{_API}.DIRECT.GET.{stream}.>",
    )


def _kv_watch(bucket: str) -> tuple[str, ...]:
    """Ordered consumers for watch/keys(), which nats-py creates, reads and removes."""
    stream = f"KV_{bucket}"
    return (
        f"{_API}.CONSUMER.CREATE.{stream}",
        f"{_API}.CONSUMER.CREATE.{stream}.>",
        f"{_API}.CONSUMER.INFO.{stream}.>",
        f"{_API}.CONSUMER.DELETE.{stream}.>",
        f"{_API}.CONSUMER.MSG.NEXT.{stream}.>",
        f"$JS.FC.{stream}.>",
    )


def _kv_write(bucket: str) -> tuple[str, ...]:
    # create on a deleted key also does a get (next-facts.md section 1), so writers read.
    return (f"$KV.{bucket}.>", *_kv_read(bucket))


def _stream_read(stream: str) -> tuple[str, ...]:
    """Info, direct/message gets and ephemeral (ordered) consumers of one stream."""
    return (
        f"{_API}.STREAM.INFO.{stream}",
        f"{_API}.STREAM.MSG.GET.{stream}",
        f"{_API}.DIRECT.GET.{stream}",
        f"{_API}.DIRECT.GET.{stream}.>",
        f"{_API}.CONSUMER.CREATE.{stream}",
        f"{_API}.CONSUMER.CREATE.{stream}.>",
        f"{_API}.CONSUMER.INFO.{stream}.>",
        f"{_API}.CONSUMER.DELETE.{stream}.>",
        f"{_API}.CONSUMER.MSG.NEXT.{stream}.>",
        f"$JS.FC.{stream}.>",
    )


def _pull(stream: str, consumer: str = "*") -> tuple[str, ...]:
    """Fetch from, and ack/nak/+WPI/term, a durable pull consumer of ``stream``."""
    return (
        f"{_API}.CONSUMER.MSG.NEXT.{stream}.{consumer}",
        f"{_API}.CONSUMER.INFO.{stream}.{consumer}",
        f"$JS.ACK.{stream}.{consumer}.>",
    )


def _objects_read(bucket: str) -> tuple[str, ...]:
    return _stream_read(f"OBJ_{bucket}")


def _objects_write(bucket: str) -> tuple[str, ...]:
    # put purges an overwritten name's old chunks (next-facts.md section 4).
    return (
        f"$O.{bucket}.>",
        f"{_API}.STREAM.PURGE.OBJ_{bucket}",
        *_objects_read(bucket),
    )


def _family(name: str) -> str:
    return f"{subjects.PREFIX}.{name}.>"


RESULTS = _family("results")
WORK = _family("work")
SUBMIT = _family("submit")

WORKER_READS: tuple[str, ...] = (
    f"{_API}.DIRECT.GET.KV_{subjects.BUCKET_WORKERS}.>",  # owned? present? (replica reads)
    f"{_API}.STREAM.MSG.GET.KV_{subjects.BUCKET_WORKERS}",  # a claim's holder (leader read)
    f"{_API}.DIRECT.GET.KV_{subjects.BUCKET_ROBOTS}.>",  # the fleet's robots.txt record
)
"""What a worker reads itself: its presence records and the fleet's robots.txt records.
The leaser writes them for it (``jf.presence``, docs/identities.md)."""

WORKER_RESULT_OBJECTS: tuple[str, ...] = (
    f"{_API}.STREAM.INFO.OBJ_{subjects.OBJECTS_RESULTS}",  # at start: the bucket exists
    f"$O.{subjects.OBJECTS_RESULTS}.C.>",  # a large body's chunks
    f"$O.{subjects.OBJECTS_RESULTS}.M.>",  # ... and its description, under a unique name
)
"""The one store a worker writes: a result body too large for a message, under a name of
its own (no purge granted, and the store refuses ``Nats-Rollup`` headers, so a chunk
publish cannot empty it: docs/security.md). The committed result carries the body's
SHA-256, which every reader checks, so a worker can spoil a body (overwrite its
description) but not pass off a forged one (docs/architecture.md#who-writes-what)."""

LEASER_RELANDS_SEALS: tuple[str, ...] = (f"{subjects.PREFIX}.results.>", f"{subjects.PREFIX}.dlq.>")
"""The leaser lands a sealed job's record when it meets the job's next delivery
(``jetfleet/settlement.py``: the sink sealed it in ``jf-fences`` and died before writing
the record). So the leaser, beside the sink, may publish results and dead letters; it
writes only what a seal carries, put-if-absent. Moving that landing behind a sink request
would leave the sink the one writer of results."""


@dataclass(frozen=True)
class RolePermissions:
    """What one role may publish and subscribe to, and why it exists.

    Attributes:
        role: the role's name (also its NATS user and its credentials file's name).
        purpose: one line for docs/security.md.
        publish: subjects it may publish on (wildcards as nats-server reads them).
        publish_deny: subjects refused even when ``publish`` matches them.
        subscribe: subjects it may subscribe to (its own inbox family is added).
        serves_requests: whether it answers requests (``allow_responses``).
        redis: whether it has a Redis user (the roles whose code opens Redis).
        cannot: what the role is refused, in words, for docs/security.md.
    """

    role: Role
    purpose: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...] = ()
    publish_deny: tuple[str, ...] = ()
    serves_requests: bool = False
    redis: bool = False
    cannot: str = ""

    @property
    def subscribe_all(self) -> tuple[str, ...]:
        """``subscribe`` with the role's own inbox family."""
        if ">" in self.subscribe:
            return self.subscribe
        return (f"{inbox_family(self.role)}.>", *self.subscribe)


_READ_EVERYTHING = (
    f"{_API}.INFO",
    f"{_API}.STREAM.LIST",
    f"{_API}.STREAM.NAMES",
    f"{_API}.STREAM.INFO.>",
    f"{_API}.STREAM.MSG.GET.>",
    f"{_API}.DIRECT.GET.>",
    f"{_API}.CONSUMER.LIST.>",
    f"{_API}.CONSUMER.NAMES.>",
    f"{_API}.CONSUMER.INFO.>",
    f"{_API}.CONSUMER.CREATE.>",
    f"{_API}.CONSUMER.DELETE.>",
    f"{_API}.CONSUMER.MSG.NEXT.>",
    "$JS.FC.>",
)
"""Reads of every stream, including ephemeral consumers to page through one."""

_NOT_WORK_OR_RESULTS = (
    # Pulling or settling a job is a worker's (and the sink's) business, never a reader's:
    # fetching from a work consumer would take a job out from under the fleet.
    f"{_API}.CONSUMER.MSG.NEXT.{subjects.STREAM_WORK}.>",
    f"{_API}.CONSUMER.MSG.NEXT.{subjects.STREAM_SUBMIT}.>",
    f"{_API}.CONSUMER.MSG.NEXT.{subjects.STREAM_ADVISORIES}.>",
    f"{_API}.CONSUMER.CREATE.{subjects.STREAM_WORK}",
    f"{_API}.CONSUMER.CREATE.{subjects.STREAM_WORK}.>",
    f"{_API}.CONSUMER.DELETE.{subjects.STREAM_WORK}.>",
    f"$JS.ACK.{subjects.STREAM_WORK}.>",
    # The services' own durable consumers: a reader removing or changing one would stall
    # admission or the backstop (readers make and remove ephemeral consumers of their
    # own). A create names the consumer with or without a filter token after it, and
    # `.>` matches only the form with one, so both are listed.
    f"{_API}.CONSUMER.DELETE.{subjects.STREAM_SUBMIT}.{subjects.CONSUMER_SCHEDULER}",
    f"{_API}.CONSUMER.CREATE.{subjects.STREAM_SUBMIT}.{subjects.CONSUMER_SCHEDULER}",
    f"{_API}.CONSUMER.CREATE.{subjects.STREAM_SUBMIT}.{subjects.CONSUMER_SCHEDULER}.>",
    f"{_API}.CONSUMER.DELETE.{subjects.STREAM_ADVISORIES}.{subjects.CONSUMER_MAX_DELIVERIES}",
    f"{_API}.CONSUMER.CREATE.{subjects.STREAM_ADVISORIES}.{subjects.CONSUMER_MAX_DELIVERIES}",
    f"{_API}.CONSUMER.CREATE.{subjects.STREAM_ADVISORIES}.{subjects.CONSUMER_MAX_DELIVERIES}.>",
    RESULTS,
    _family("dlq"),
    WORK,
)

ROLES: dict[Role, RolePermissions] = {
    role.role: role
    for role in (
        RolePermissions(
            role="admin",
            purpose="declares the topology (`jetfleet topology apply`), runs the dev "
            "harness and the tests' own connections",
            publish=(">",),
            subscribe=(">",),
            serves_requests=True,
            redis=True,
            cannot="nothing is refused: keep these credentials off every running fleet process",
        ),
        RolePermissions(
            role="operator",
            purpose="the CLI: control (quarantine, breaker, pause, versions, target limits, "
            "dead-letter replay) and every read (status, doctor, results, audit)",
            publish=(
                SUBMIT,
                subjects.QUARANTINE,
                subjects.BREAKER,
                PAUSE,
                VERSIONS,
                AUDIT,
                *_READ_EVERYTHING,
                f"$KV.{subjects.BUCKET_TARGETS}.>",
                f"{_API}.STREAM.MSG.DELETE.{subjects.STREAM_DLQ}",
                f"{_API}.STREAM.PURGE.{subjects.STREAM_DLQ}",  # jetfleet dlq purge
                f"$KV.{subjects.BUCKET_CONTROL}.purged.dlq.>",  # what each purge removed
            ),
            publish_deny=_NOT_WORK_OR_RESULTS,
            redis=True,
            cannot="forge results or dead letters, pull or settle work, write leases, "
            "fences or the control bucket (but for its dead-letter purge counts; it asks the "
            "leaser for the rest), create or delete streams",
        ),
        RolePermissions(
            role="client",
            purpose="submits jobs (reading one back by its sequence when a retried "
            "publish is answered duplicate) and reads committed results, dead letters and "
            "rejections",
            publish=(
                SUBMIT,
                # A stored submission by sequence, no consumer: a publish retried after
                # its answer was lost is told from a real duplicate by reading back what
                # the stream holds (client.py, _stored_as). Without it a client's own
                # submission was reported a duplicate. The server grants the subject, not
                # the sequence: any submission can be read (docs/security.md).
                f"{_API}.STREAM.MSG.GET.{subjects.STREAM_SUBMIT}",
                *_stream_read(subjects.STREAM_RESULTS),
                *_stream_read(subjects.STREAM_DLQ),
                *_stream_read(subjects.STREAM_REJECTED),
                *_objects_read(subjects.OBJECTS_RESULTS),
                f"{_API}.STREAM.NAMES",
            ),
            cannot="control anything, read work, leases or outcomes, write any stream "
            "but submissions",
        ),
        RolePermissions(
            role="scheduler",
            purpose="admits submissions and routes them to the work stream",
            publish=(
                WORK,
                _family("rejected"),
                *_pull(subjects.STREAM_SUBMIT, subjects.CONSUMER_SCHEDULER),
                *_kv_write(subjects.BUCKET_FENCES),  # id claims
                *_kv_read(subjects.BUCKET_LEASES),
                *_kv_read(subjects.BUCKET_CONTROL),
                f"{_API}.STREAM.INFO.{subjects.STREAM_SUBMIT}",
                f"{_API}.STREAM.INFO.{subjects.STREAM_WORK}",
            ),
            cannot="commit results, grant leases, control anything",
        ),
        RolePermissions(
            role="leaser",
            purpose="grants, renews and releases leases; serves quarantine, breaker, "
            "pause, versions and presence requests; pauses work consumers",
            publish=(
                *LEASER_RELANDS_SEALS,
                _family("duplicates"),  # before already-done (jetfleet/duplicates.py)
                subjects.RATELIMIT,
                _family("alert"),
                _family("outcome"),
                AUDIT,
                *_kv_write(subjects.BUCKET_LEASES),
                *_kv_watch(subjects.BUCKET_LEASES),
                *_kv_write(subjects.BUCKET_FENCES),
                *_kv_write(subjects.BUCKET_CONTROL),
                *_kv_watch(subjects.BUCKET_CONTROL),
                *_kv_write(subjects.BUCKET_WORKERS),  # presence, for workers (jf.presence)
                *_kv_watch(subjects.BUCKET_WORKERS),
                *_kv_write(subjects.BUCKET_ROBOTS),
                *_kv_read(subjects.BUCKET_TARGETS),
                *_kv_watch(subjects.BUCKET_TARGETS),
                *_objects_write(subjects.OBJECTS_RESULTS),
                f"$JS.ACK.{subjects.STREAM_WORK}.>",  # revoke: nak the live delivery
                f"{_API}.CONSUMER.PAUSE.{subjects.STREAM_WORK}.>",
                f"{_API}.CONSUMER.INFO.{subjects.STREAM_WORK}.>",
                f"{_API}.CONSUMER.LIST.{subjects.STREAM_WORK}",
                f"{_API}.STREAM.INFO.{subjects.STREAM_WORK}",
                f"{_API}.STREAM.INFO.{subjects.STREAM_OUTCOMES}",
                # Results by key (already_done); no JF_DLQ read: the seal is the dead
                # mark, and the leaser only writes a sealed job's letter (put-if-absent).
                f"{_API}.STREAM.MSG.GET.{subjects.STREAM_RESULTS}",
                f"{_API}.DIRECT.GET.{subjects.STREAM_RESULTS}.>",
                *_stream_read(subjects.STREAM_OUTCOMES),
            ),
            subscribe=(
                subjects.LEASE,
                subjects.QUARANTINE,
                subjects.QUARANTINE_ANSWER,
                subjects.BREAKER,
                PAUSE,
                VERSIONS,
                PRESENCE,
            ),
            serves_requests=True,
            redis=True,
            cannot="pull work, create or delete streams (results and dead letters only "
            "as a seal in jf-fences carries them, see LEASER_RELANDS_SEALS)",
        ),
        RolePermissions(
            role="ratelimit",
            purpose="answers permit and hold requests from Redis",
            publish=(
                *_kv_read(subjects.BUCKET_TARGETS),
                *_kv_watch(subjects.BUCKET_TARGETS),
                *_kv_read(subjects.BUCKET_ROBOTS),
                *_kv_watch(subjects.BUCKET_ROBOTS),
            ),
            subscribe=(subjects.RATELIMIT,),
            serves_requests=True,
            redis=True,
            cannot="publish on any jetfleet subject, write any bucket",
        ),
        RolePermissions(
            role="quarantine",
            purpose="reads outcome events, applies the quarantine and breaker rules and the "
            "rollout guard (withdrawals through the leaser)",
            publish=(
                subjects.QUARANTINE,
                subjects.BREAKER,
                VERSIONS,  # the rollout guard's withdrawals go through the leaser
                _family("alert"),
                *_stream_read(subjects.STREAM_OUTCOMES),
                f"{_API}.CONSUMER.DURABLE.CREATE.{subjects.STREAM_OUTCOMES}.>",
                *_kv_write(subjects.BUCKET_CONTROL),
                *_kv_watch(subjects.BUCKET_CONTROL),
                *_kv_read(subjects.BUCKET_WORKERS),
                *_kv_watch(subjects.BUCKET_WORKERS),
            ),
            cannot="grant leases, commit results, pull work",
        ),
        RolePermissions(
            role="sink",
            purpose="the commit point: checks fences, writes results and dead letters, "
            "settles exhausted jobs",
            publish=(
                RESULTS,
                _family("dlq"),
                _family("rejected"),
                _family("duplicates"),
                _family("outcome"),
                *_kv_write(subjects.BUCKET_FENCES),
                *_kv_write(subjects.BUCKET_LEASES),
                *_kv_read(subjects.BUCKET_CONTROL),
                # The backstop's dead letter says why a job was handed back last.
                *_kv_read(subjects.BUCKET_WORKERS),
                *_pull(subjects.STREAM_ADVISORIES, subjects.CONSUMER_MAX_DELIVERIES),
                f"$JS.ACK.{subjects.STREAM_WORK}.>",
                f"{_API}.STREAM.MSG.GET.{subjects.STREAM_WORK}",
                f"{_API}.STREAM.MSG.DELETE.{subjects.STREAM_WORK}",
                f"{_API}.STREAM.INFO.{subjects.STREAM_WORK}",
                f"{_API}.STREAM.INFO.{subjects.STREAM_RESULTS}",
                f"{_API}.STREAM.MSG.GET.{subjects.STREAM_RESULTS}",
                f"{_API}.DIRECT.GET.{subjects.STREAM_RESULTS}.>",
                f"{_API}.STREAM.MSG.GET.{subjects.STREAM_DLQ}",
                f"{_API}.DIRECT.GET.{subjects.STREAM_DLQ}.>",
                *_stream_read(subjects.STREAM_OUTCOMES),
                *_objects_read(subjects.OBJECTS_RESULTS),
            ),
            subscribe=(f"{subjects.SINK_REPORT}.>",),
            serves_requests=True,
            redis=True,  # frees a settled job's in-flight place (target_places.py)
            cannot="grant leases, pull work, control anything",
        ),
        RolePermissions(
            role="gateway",
            purpose="the HTTP API and dashboard: submissions, status reads, and the "
            "dashboard's control actions behind the gateway token (pause, proposal "
            "answers, dead-letter replay)",
            # The dashboard asks the leaser on jf.pause as the CLI does, and answers
            # egress proposals on jf.quarantine-answer (the leaser records both), and
            # records its own replays in the audit log: that one action only, so it
            # cannot forge any other entry.
            publish=(
                SUBMIT,
                PAUSE,
                # Proposal answers only: jf.quarantine would let these credentials set or
                # release any quarantine, and the leaser cannot tell who sent a command.
                subjects.QUARANTINE_ANSWER,
                AUDIT_REPLAY,
                *_READ_EVERYTHING,
            ),
            publish_deny=_NOT_WORK_OR_RESULTS,
            redis=True,
            cannot="commit results, pull work, write any bucket, open breakers, set or "
            "release quarantines, approve versions, set target limits, write audit entries "
            "but its dead-letter replays",
        ),
        RolePermissions(
            role="worker",
            purpose="pulls its targets' work, asks for leases and permits, reports "
            "attempts and outcomes",
            publish=(
                subjects.LEASE,
                subjects.RATELIMIT,
                PRESENCE,
                f"{subjects.SINK_REPORT}.>",
                _family("outcome"),
                f"{_API}.CONSUMER.MSG.NEXT.{subjects.STREAM_WORK}.>",
                f"$JS.ACK.{subjects.STREAM_WORK}.>",
                # The server's clock, read from a stream info answer (server_clock.py).
                f"{_API}.STREAM.INFO.{subjects.STREAM_WORK}",
                *WORKER_READS,
                *WORKER_RESULT_OBJECTS,
            ),
            cannot="pause, approve versions, quarantine, write leases, fences or the "
            "control bucket, publish results or dead letters, purge or delete anything, "
            "administer JetStream, read another role's replies",
        ),
    )
}


def permissions(role: Role) -> RolePermissions:
    """The permissions of ``role``."""
    return ROLES[role]


ROLES_DOC_BEGIN = "<!-- roles table: generated by `jetfleet auth roles`; do not edit -->"
ROLES_DOC_END = "<!-- end of roles table -->"


def roles_markdown() -> str:
    """The roles as docs/security.md shows them (a test keeps the doc equal to this)."""
    lines = [
        ROLES_DOC_BEGIN,
        "",
        "| role | what it is for | Redis user | refused |",
        "|---|---|---|---|",
    ]
    for perms in ROLES.values():
        redis = "yes" if perms.redis else "no"
        lines.append(f"| `{perms.role}` | {perms.purpose} | {redis} | {perms.cannot} |")
    for perms in ROLES.values():
        lines += ["", f"#### `{perms.role}`", "", "May publish:", ""]
        lines += [f"- `{subject}`" for subject in perms.publish]
        if perms.publish_deny:
            lines += ["", "Never, even where the above matches:", ""]
            lines += [f"- `{subject}`" for subject in perms.publish_deny]
        lines += ["", "May subscribe:", ""]
        lines += [f"- `{subject}`" for subject in perms.subscribe_all]
        if perms.serves_requests:
            lines += ["", "Answers requests it receives (`allow_responses`)."]
    lines += ["", ROLES_DOC_END]
    return "\n".join(lines) + "\n"
