"""The wire contract: generated schema files, the CI currency guard, I9, and round trips."""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jetfleet.schemas as wire
import msgspec
import pytest
from jetfleet.schemas import (
    AttemptRecord,
    CommittedResult,
    DeadLetter,
    Duplicate,
    Failure,
    HttpFetch,
    Job,
    LeaseAlreadyDone,
    LeaseGrant,
    LeaseRefusal,
    LeaseRelease,
    LeaseRenew,
    LeaseRequest,
    NoopOutput,
    Outcome,
    OutcomeBatch,
    Rejection,
    SinkReply,
    Success,
    Versions,
    WorkOrder,
)
from jetfleet.schemas.audit import AuditEntry
from jetfleet.schemas.breaker import (
    BreakerAlert,
    BreakerClose,
    BreakerList,
    BreakerOpen,
    BreakerProbe,
    BreakerRecord,
    BreakerReply,
    BreakerView,
)
from jetfleet.schemas.control import (
    PauseList,
    PauseRecord,
    PauseReply,
    PauseResume,
    PauseSet,
    PauseView,
)
from jetfleet.schemas.lease import (
    AvoidEntry,
    Evidence,
    JobLeaseHistory,
    LeaseRecord,
    QuarantineApprove,
    QuarantineFired,
    QuarantineList,
    QuarantineProposal,
    QuarantineRecord,
    QuarantineReject,
    QuarantineRelease,
    QuarantineReply,
    QuarantineRetired,
    QuarantineSet,
)
from jetfleet.schemas.permit import (
    HoldPlaced,
    HoldRequest,
    PermitAllowed,
    PermitRefused,
    PermitRequest,
    PermitWait,
)
from jetfleet.schemas.presence import (
    PresenceCreate,
    PresenceDelete,
    PresencePut,
    PresenceRefused,
    PresenceUpdate,
    PresenceWritten,
)
from jetfleet.schemas.report import Malformed
from jetfleet.schemas.targets import RobotsRecord, TargetLimits
from jetfleet.schemas.versions import (
    ApprovedShown,
    GuardFigures,
    SeenShown,
    VersionAlert,
    VersionApproval,
    VersionsApprove,
    VersionsGuard,
    VersionSighting,
    VersionsList,
    VersionsReply,
    VersionsRevoke,
    VersionView,
    VersionWithdrawal,
    WithdrawnShown,
)

import jetfleet
from jetfleet.ops import schema_export
from jetfleet.wire_catalog import CHANNELS, Channel

FIX = "jetfleet schemas export"

# --- export / check ------------------------------------------------------------------


def test_export_then_check_is_clean(tmp_path: Path) -> None:
    written = schema_export.export(tmp_path)

    assert schema_export.check(tmp_path) == []
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written) == sorted(
        schema_export.render()
    )


def test_export_writes_one_schema_per_channel_and_the_asyncapi_document(tmp_path: Path) -> None:
    schema_export.export(tmp_path)

    names = {path.name for path in (tmp_path / "json").iterdir()}
    assert names == {f"{channel.name}.schema.json" for channel in CHANNELS}
    assert (tmp_path / "asyncapi.json").is_file()


def test_check_reports_a_modified_file_with_the_fix(tmp_path: Path) -> None:
    schema_export.export(tmp_path)
    edited = tmp_path / "json" / "submit.schema.json"
    edited.write_bytes(edited.read_bytes().replace(b'"Job"', b'"Jobb"'))

    problems = schema_export.check(tmp_path)

    assert len(problems) == 1
    assert str(edited) in problems[0] and "out of date" in problems[0] and FIX in problems[0]


def test_check_reports_a_deleted_file_with_the_fix(tmp_path: Path) -> None:
    schema_export.export(tmp_path)
    (tmp_path / "asyncapi.json").unlink()

    problems = schema_export.check(tmp_path)

    assert len(problems) == 1
    assert "asyncapi.json" in problems[0] and "missing" in problems[0] and FIX in problems[0]


def test_check_reports_an_extra_schema_file_and_export_removes_it(tmp_path: Path) -> None:
    schema_export.export(tmp_path)
    extra = tmp_path / "json" / "retired.schema.json"
    extra.write_text("{}\n")

    problems = schema_export.check(tmp_path)
    assert len(problems) == 1
    assert str(extra) in problems[0] and FIX in problems[0]

    schema_export.export(tmp_path)
    assert not extra.exists()
    assert schema_export.check(tmp_path) == []


def test_check_of_an_empty_folder_reports_every_file_missing(tmp_path: Path) -> None:
    problems = schema_export.check(tmp_path)

    assert len(problems) == len(schema_export.render())
    assert all("missing" in problem for problem in problems)


def test_committed_schema_files_are_current() -> None:
    """The CI guard: the files committed next to the Structs match what the code renders."""
    assert schema_export.check(schema_export.default_dir()) == []


def test_render_is_deterministic_sorted_two_space_json_with_a_trailing_newline() -> None:
    first, second = schema_export.render(), schema_export.render()

    assert first == second
    for content in first.values():
        text = content.decode()
        assert (
            text
            == json.dumps(json.loads(text), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        )


# --- the AsyncAPI document -----------------------------------------------------------


def _asyncapi() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(schema_export.render()["asyncapi.json"])
    return loaded


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


def _resolve(document: dict[str, Any], ref: str) -> Any:
    node: Any = document
    for token in ref.removeprefix("#/").split("/"):
        node = node[token.replace("~1", "/").replace("~0", "~")]
    return node


def test_asyncapi_document_describes_every_channel() -> None:
    document = _asyncapi()

    assert document["asyncapi"] == "3.0.0"
    assert document["info"]["title"] == "jetfleet"
    assert document["info"]["version"] == jetfleet.__version__
    assert set(document["channels"]) == {channel.name for channel in CHANNELS}
    for channel in CHANNELS:
        assert document["channels"][channel.name]["address"] == (channel.address or None)


def test_every_asyncapi_reference_resolves_inside_the_document() -> None:
    document = _asyncapi()

    for ref in _refs(document):
        assert ref.startswith("#/"), ref
        _resolve(document, ref)


def test_request_channels_have_send_and_receive_operations_with_their_reply() -> None:
    operations = _asyncapi()["operations"]

    for channel in CHANNELS:
        if channel.kind == "reply":
            continue
        assert operations[f"send-{channel.name}"]["action"] == "send"
        assert operations[f"receive-{channel.name}"]["action"] == "receive"
        if channel.kind == "request":
            receive = operations[f"receive-{channel.name}"]
            assert receive["reply"]["channel"]["$ref"] == f"#/channels/{channel.reply}"
            assert receive["bindings"]["nats"]["queue"] == channel.queue_group


def test_every_exported_wire_struct_is_reachable_from_a_channel() -> None:
    """A Struct in jetfleet.schemas that no channel carries has no published contract."""
    components = _asyncapi()["components"]["schemas"]
    structs = {
        name
        for name in wire.__all__
        if isinstance(obj := getattr(wire, name), type) and issubclass(obj, msgspec.Struct)
    }

    assert structs - set(components) == set()


def test_asyncapi_schemas_use_no_openapi_discriminator_objects() -> None:
    """AsyncAPI's `discriminator` is a string; msgspec's object form moves to an x- key."""
    for node in _schema_nodes(_asyncapi()["components"]):
        assert not isinstance(node.get("discriminator"), dict)


# --- I9: durations, never wall-clock deadlines ---------------------------------------

FORBIDDEN_IN_NAMES = ("deadline", "expires_at", "until", "timestamp")


def _schema_nodes(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _schema_nodes(value)
    elif isinstance(node, list):
        for item in node:
            yield from _schema_nodes(item)


def _properties(schema: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    for node in _schema_nodes(schema):
        properties = node.get("properties")
        if isinstance(properties, dict):
            yield from properties.items()


def _i9_schema_violations(schema: Any) -> list[str]:
    problems = [
        f"date-time format in {node}"
        for node in _schema_nodes(schema)
        if node.get("format") == "date-time"
    ]
    for name, prop in _properties(schema):
        if any(word in name for word in FORBIDDEN_IN_NAMES) or name.endswith("_at"):
            problems.append(f"{name!r} looks like a wall-clock time")
        # JSON Schema's integer is a number too; either is a duration in seconds.
        if name.endswith("_s") and prop.get("type") not in ("number", "integer"):
            problems.append(f"{name!r} ends in _s but is not a number: {prop}")
    return problems


WALL_CLOCK_TYPES = (
    msgspec.inspect.DateTimeType,
    msgspec.inspect.DateType,
    msgspec.inspect.TimeType,
)


def _type_nodes(node: object, seen: set[int]) -> Iterator[object]:
    # Recursive Structs make the inspected type graph cyclic.
    if id(node) in seen:
        return
    seen.add(id(node))
    yield node
    if isinstance(node, msgspec.Struct):
        for field in msgspec.structs.fields(node):
            yield from _type_nodes(getattr(node, field.name), seen)
    elif isinstance(node, tuple | list):
        for item in node:
            yield from _type_nodes(item, seen)


def _i9_type_violations(payload: Any) -> list[str]:
    """Wall-clock types in a payload: msgspec renders datetime as a plain string, with no
    ``format``, so the schema walk alone would miss a ``datetime`` field."""
    return [
        f"wall-clock type {node!r}"
        for node in _type_nodes(msgspec.inspect.type_info(payload), set())
        if isinstance(node, WALL_CLOCK_TYPES)
    ]


class _BadInner(msgspec.Struct):
    expires_at: datetime.datetime
    ttl_s: str


class _BadOuter(msgspec.Struct):
    inner: _BadInner
    retry_until: float


def test_I9_no_wall_clock_deadline_in_any_payload_schema() -> None:
    for rel, content in schema_export.render().items():
        assert _i9_schema_violations(json.loads(content)) == [], rel
    for channel in CHANNELS:
        assert _i9_type_violations(channel.payload) == [], channel.name


def test_I9_check_catches_deadlines_and_non_numeric_durations() -> None:
    """Guards the guard: the walkers must see nested fields, or the test above is vacuous."""
    schema_problems = _i9_schema_violations(msgspec.json.schema(_BadOuter))
    type_problems = _i9_type_violations(_BadOuter)

    assert len(schema_problems) == 3, schema_problems
    assert len(type_problems) == 1, type_problems
    assert _i9_schema_violations({"properties": {"at": {"type": "string", "format": "date-time"}}})


# --- round trips ---------------------------------------------------------------------

VERSIONS = Versions(jetfleet="0.1.0")
JOB = Job(id="job-1", url="https://example.test/page")
ORDER = WorkOrder(
    job=JOB, target="example", key="url:example.test/page", max_attempts=3, timeout_s=30.0
)
BREAKER = BreakerRecord(
    target="example",
    cool_s=900.0,
    reason="3 identities refused",
    opened_by="breaker",
    identities=["a", "b", "worker:w1"],
    evidence=[Evidence(job_id=JOB.id, seq=41, reason="blocked")],
)
VERSION_TUPLE = Versions(
    jetfleet="0.1.0",
    code="0.1.0+g28b97837e8ec",
    config="4ade1394aed4",
    python="3.11.7",
    nats_py="2.16.0",
    declared={"ring": "canary"},
    id="680715540608",
)
GUARD_FIGURES = GuardFigures(
    window_s=1800.0,
    fraction=0.8,
    sample=50,
    success_rate=0.5,
    block_rate=0.4,
    incumbent="0123456789ab",
    incumbent_sample=60,
    incumbent_success_rate=0.95,
    incumbent_block_rate=0.01,
)
VERSION_SAMPLES = (
    VersionsList(),
    VersionsApprove(versions=VERSION_TUPLE, by="ops", why="rolled out"),
    VersionsRevoke(id="680715540608", by="rollout-guard", figures=GUARD_FIGURES),
    VersionsGuard(on=False, by="ops", why="incident"),
    VersionsReply(
        ok=True,
        view=VersionView(
            approved=[ApprovedShown(id="680715540608", versions=VERSION_TUPLE, incumbent=True)],
            seen=[SeenShown(id="680715540608", versions=VERSION_TUPLE, worker="w1")],
            withdrawn=[WithdrawnShown(id="0123456789ab", by="ops", figures=GUARD_FIGURES)],
        ),
    ),
    VersionAlert(id="680715540608", by="rollout-guard", figures=GUARD_FIGURES),
    VersionApproval(versions=VERSION_TUPLE, by="ops"),
    VersionWithdrawal(versions=VERSION_TUPLE, by="ops", why="bad build"),
    VersionSighting(versions=VERSION_TUPLE, worker="w1"),
)
OUTCOME = Outcome(
    job_id=JOB.id,
    target="example",
    worker="w1",
    attempt=1,
    kind="ok",
    duration_s=0.25,
    versions=VERSIONS,
)

SAMPLES: dict[type[msgspec.Struct], msgspec.Struct] = {
    sample.__class__: sample
    for sample in (
        JOB,
        ORDER,
        Success(
            order=ORDER,
            worker="w1",
            attempt=1,
            duration_s=0.25,
            output=HttpFetch(status=200, final_url=JOB.url),
            versions=VERSIONS,
        ),
        Failure(
            order=ORDER,
            worker="w1",
            reason="http-404",
            history=[AttemptRecord(attempt=1, worker="w1")],
            versions=VERSIONS,
        ),
        SinkReply(status="committed"),
        Malformed(
            worker="w1", subject="jf.work.example.normal", stream_seq=3, error="not JSON", raw=b"{"
        ),
        CommittedResult(
            job_id=JOB.id,
            target="example",
            url=JOB.url,
            key=ORDER.key,
            handler=JOB.handler,
            worker="w1",
            attempt=1,
            duration_s=0.25,
            output=NoopOutput(),
            versions=VERSIONS,
        ),
        DeadLetter(order=ORDER, reason="attempts-exhausted", history=[]),
        Duplicate(
            job_id="job-2", target="example", key=ORDER.key, committed_by=JOB.id, via="already-done"
        ),
        Rejection(reason="invalid-json", message="not JSON", subject="jf.submit.example", raw=b"{"),
        OUTCOME,
        OutcomeBatch(events=[OUTCOME]),
        LeaseRequest(
            job_id=JOB.id, target="example", key=ORDER.key, worker="w1", versions=VERSIONS
        ),
        LeaseRenew(job_id=JOB.id, fence=7),
        LeaseRelease(job_id=JOB.id, fence=7, refund=True, avoid_reason="challenged"),
        LeaseGrant(fence=7, ttl_s=30.0),
        LeaseRefusal(reason="paused", retry_after_s=5.0),
        LeaseAlreadyDone(key=ORDER.key),
        LeaseRecord(job_id=JOB.id, target="example", worker="w1", reply_subject="$JS.ACK.x"),
        JobLeaseHistory(
            fence=7, grants=2, avoid=[AvoidEntry(scope="worker", name="w1", reason="blocked")]
        ),
        QuarantineSet(record=QuarantineRecord(scope="worker", name="w1", target="example")),
        QuarantineRelease(scope="identity", name="p-osaka", target="example"),
        QuarantineList(),
        QuarantineReply(ok=True, revoked=[JOB.id]),
        QuarantineRecord(
            scope="identity",
            name="p-osaka",
            target="example",
            for_s=60.0,
            set_by="rule:retire-3",
            evidence=[Evidence(job_id=JOB.id, seq=41, reason="challenged")],
        ),
        QuarantineFired(seq=41),
        QuarantineApprove(id="0123456789abcdef"),
        QuarantineReject(id="0123456789abcdef", reason="our own crawl test"),
        QuarantineProposal(
            id="0123456789abcdef",
            subnet="10.1.0.0/24",
            target="example",
            for_s=3600.0,
            set_by="rule:egress-subnet-blocked",
            identities=["id-a", "id-b"],
            evidence=[Evidence(job_id=JOB.id, seq=41, reason="blocked")],
        ),
        QuarantineRetired(identity="id-a", subnet="10.1.0.0/24"),
        AvoidEntry(scope="identity", name="p-osaka", reason="challenged"),
        BREAKER,
        BreakerOpen(record=BREAKER, after_opens=1),
        BreakerClose(target="example", opens=1, by="probe", reason="the probe was answered"),
        BreakerList(),
        BreakerReply(
            ok=True,
            breakers=[
                BreakerView(
                    record=BREAKER,
                    state="probing",
                    probe=BreakerProbe(job_id=JOB.id, worker="w1", fence=7),
                )
            ],
            revoked=[JOB.id],
        ),
        BreakerProbe(job_id=JOB.id, worker="w1", fence=7),
        BreakerAlert(
            target="example", change="opened", by="breaker", cool_s=900.0, opens=1, identities=["a"]
        ),
        *VERSION_SAMPLES,
        PermitRequest(target="example", worker="w1", identity="p-osaka", egress="eu-1"),
        HoldRequest(target="example", status=429, said_how_long=True, retry_after_s=3.0),
        PermitAllowed(),
        PermitWait(retry_after_s=0.2, limit="target", detail="next in 0.200 s"),
        HoldPlaced(hold_s=3.0, streak=2),
        PermitRefused(reason="ratelimit-unavailable", detail="redis: connection refused"),
        TargetLimits(rate=5.0, burst=2, daily=50000, set_by="ops@host", reason="owner asked"),
        RobotsRecord(target="example", status=200, body="User-agent: *\n", crawl_delay_s=2.0),
        PresenceCreate(bucket="jf-workers", key="owned." + "0" * 32, value=b"a\nw1\nt", ttl_s=30),
        PresenceUpdate(
            bucket="jf-workers", key="owned." + "0" * 32, value=b"a\nw1\nt", last=3, ttl_s=30
        ),
        PresencePut(bucket="jf-workers", key="handback.j-1", value=b"target-held", ttl_s=3600),
        PresenceDelete(bucket="jf-workers", key="owned." + "0" * 32, last=4),
        PresenceWritten(revision=5),
        PresenceRefused(reason="wrong-revision", detail="jf-workers owned.0 moved"),
        PauseSet(scope="target", name="example", for_s=1800.0, mode="now", by="ops", why="x"),
        PauseResume(scope="identity", name="p-osaka", by="ops", why="cleared"),
        PauseList(),
        PauseRecord(scope="fleet", for_s=60.0, by="ops", why="incident 42"),
        PauseReply(
            ok=True,
            pauses=[
                PauseView(record=PauseRecord(scope="worker", name="w1"), age_s=3.0, revision=12)
            ],
            revoked=[JOB.id],
            consumers=["work-example-normal"],
        ),
        AuditEntry(
            action="quarantine.set",
            who="ana",
            what="identity id-1 on example until released",
            why="blocks",
            detail="revoked 1 lease(s)",
        ),
    )
}


def _cases() -> Iterator[Any]:
    for channel in CHANNELS:
        for member in channel.members:
            yield pytest.param(channel, member, id=f"{channel.name}-{member.__name__}")


def test_every_channel_payload_member_has_a_round_trip_sample() -> None:
    missing = {m.__name__ for channel in CHANNELS for m in channel.members} - {
        t.__name__ for t in SAMPLES
    }

    assert missing == set(), "add a sample to SAMPLES for each new wire type"


@pytest.mark.parametrize(("channel", "member"), list(_cases()))
def test_channel_payload_round_trips_through_json(
    channel: Channel, member: type[msgspec.Struct]
) -> None:
    sample = SAMPLES.get(member)
    if sample is None:
        pytest.fail(f"no sample for {member.__name__}")

    decoded = msgspec.json.decode(msgspec.json.encode(sample), type=channel.payload)

    assert type(decoded) is member
    assert decoded == sample


def test_a_minimal_job_and_work_order_encode_only_what_was_set() -> None:
    assert msgspec.json.decode(msgspec.json.encode(JOB)) == {"id": JOB.id, "url": JOB.url}
    assert msgspec.json.decode(msgspec.json.encode(ORDER), type=WorkOrder) == ORDER


def test_a_quarantine_record_kept_before_set_by_and_evidence_still_decodes() -> None:
    old = b'{"scope":"worker","name":"w1","target":"example","reason":"403 storm","for_s":60}'
    record = msgspec.json.decode(old, type=QuarantineRecord)
    assert (record.set_by, record.evidence, record.reason) == ("", [], "403 storm")
