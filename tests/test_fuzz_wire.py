"""Fuzzed wire (issue 14): hypothesis-generated messages on every subject a service or
worker consumes, against the real services on a real nats-server and redis-server.

Subjects fuzzed (``FUZZED`` below; ``test_every_consumed_subject_is_fuzzed`` fails when a
service serves a request subject, or the wire catalogue lists a channel, that this table
neither fuzzes nor explains):

==================================================  ==========  =========================
subject                                              published   consumed by
                                                     here as
==================================================  ==========  =========================
``jf.submit.<target>``                               client      scheduler
``jf.work.<target>.<tier>``                          scheduler   workers
``jf.lease``                                         worker      leaser
``jf.presence``                                      worker      leaser
``jf.pause``                                         operator    leaser
``jf.quarantine``                                    operator    leaser
``jf.quarantine-answer``                             gateway     leaser
``jf.breaker``                                       operator    leaser
``jf.versions``                                      operator    leaser
``jf.ratelimit``                                     worker      ratelimit
``jf.sink.report.<target>``                          worker      sink
``$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.>``     admin       sink (via JF_ADVISORIES)
``jf.outcome.<target>`` (``Jf-Job``, ``Jf-Batch``)    worker      quarantine, gateway tail
gateway ``POST`` bodies (jobs, pause, resume,        (token)     gateway
proposals, dead-letter replay)
==================================================  ==========  =========================

Each message is valid (built from the msgspec types in schemas/), near-valid, garbage,
oversized or hostile (tests/wire_strategies.py). What must hold:

- request/reply subjects: every message is answered, the answer decodes as the reply
  type, a message the request type does not decode (or over the route's byte cap) is
  refused, every refusal carries a reason, and no handler raised (the responder's
  ``failed`` count stays 0). After each batch a known-valid request is answered by its
  handler, and a valid job submitted afterwards is committed.
- stream subjects: every message ends somewhere a user can see it: submissions
  committed, dead-lettered or rejected on ``jf.rejected`` with a reason (I3 holds); work
  orders run or kept on ``jf.rejected``; outcome events counted or skipped (logged with
  the reason); advisories acked. The consumer keeps consuming.

The run is fixed and bounded: the ``fuzz-ci`` hypothesis profile (tests/conftest.py,
docs/fuzzing.md) derandomizes and caps the examples; ``--hypothesis-profile=fuzz-long``
runs many more.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from jetfleet.schemas import (
    Job,
    LeaseRefusal,
    LeaseReply,
    Outcome,
    OutcomeBatch,
    Report,
    SinkReply,
    Versions,
    WorkOrder,
)
from jetfleet.schemas.breaker import BreakerClose, BreakerCommand, BreakerList, BreakerReply
from jetfleet.schemas.control import PauseCommand, PauseList, PauseReply, PauseResume
from jetfleet.schemas.events import Rejection
from jetfleet.schemas.lease import (
    LeaseCall,
    LeaseRenew,
    QuarantineApprove,
    QuarantineCommand,
    QuarantineList,
    QuarantineReject,
    QuarantineRelease,
    QuarantineReply,
)
from jetfleet.schemas.names import IdempotencyKey
from jetfleet.schemas.permit import PermitCall, PermitRequest, RatelimitReply
from jetfleet.schemas.presence import PresenceReply, PresenceWrite
from jetfleet.schemas.versions import VersionsCommand, VersionsList, VersionsReply
from jetfleet.services.gateway import Gateway
from jetfleet.services.sink.exhausted import MaxDeliveriesAdvisory
from nats.aio.client import Client as NatsClient
from nats.js.api import ConsumerInfo

from jetfleet import subjects
from jetfleet.auth.bundle import Bundle
from jetfleet.auth.credentials import settings_for_role
from jetfleet.auth.roles import Role
from jetfleet.client import jobs_for, submit_jobs
from jetfleet.connection import connect_nats
from jetfleet.outcome_events import (
    BATCH_HEADER,
    JOB_HEADER,
    MAX_BATCH_BYTES,
    read_outcome,
    read_outcomes,
)
from jetfleet.responder import Responder
from jetfleet.settings import GatewaySettings, Settings
from jetfleet.simulator import SimulatorConfig, TargetSimulator
from jetfleet.stream_reader import read_stream
from jetfleet.wire_catalog import CHANNELS
from tests import wire_strategies as ws
from tests.conftest import admin_url, make_settings, sim_target, start_nats, wait_for
from tests.stack import InProcessStack

BATCH = 12
"""Messages per example: many per example keeps the examples (and the stack's rounds
of liveness checks) few."""
FUZZ_TARGET = "fuzz"
"""Valid control commands, leases, permits and outcome events go here, never to
``demo``, where the liveness jobs run."""
TOKEN = "fuzz-gateway-token"
REPLY_TIMEOUT_S = 10.0
SETTLE_S = 30.0

_ROLES: tuple[Role, ...] = ("admin", "client", "scheduler", "worker", "operator", "gateway")


@dataclass(repr=False)
class FuzzStack:
    """The services, a worker, a quarantine replica and a gateway over real servers, and
    one connection per role the fuzz publishes as."""

    settings: Settings
    stack: InProcessStack
    gateway: Gateway
    as_role: dict[Role, NatsClient]
    http: aiohttp.ClientSession
    jobs: int = 0
    """Liveness jobs submitted so far (their ids are unique)."""
    responders: dict[str, Responder] = field(default_factory=dict)

    @property
    def admin(self) -> NatsClient:
        return self.as_role["admin"]

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        # How hypothesis prints a failing example's arguments: this one in a word, not
        # its settings (with the session's test credentials) and connections.
        printer.text("FuzzStack(...)")


@pytest.fixture(scope="module")
async def fuzz(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, auth_bundle: Bundle | None
) -> AsyncIterator[FuzzStack]:
    """One stack for the whole module (starting one per example would cost seconds each).
    The version gate is off: valid ``jf.versions`` commands approve random tuples, and
    the fuzz is about decoding and refusing, not about the gate (test_I8_versions.py)."""
    server = start_nats(Path(tmp_path_factory.mktemp("fuzz-nats")))
    try:
        async with TargetSimulator(SimulatorConfig()) as sim:
            targets = {"demo": sim_target(sim), FUZZ_TARGET: sim_target(sim)}
            base = make_settings(admin_url(server.url), redis_url, targets)
            settings = msgspec.structs.replace(
                base,
                versions=msgspec.structs.replace(base.versions, gate="off"),
                gateway=GatewaySettings(port=0, token=TOKEN),
            )
            async with _running(settings) as running:
                yield running
    finally:
        server.stop()


@contextlib.asynccontextmanager
async def _running(settings: Settings) -> AsyncIterator[FuzzStack]:
    stack = InProcessStack(settings)
    await stack.start(workers=1)
    await stack.add_quarantine()
    gw_nc = await connect_nats(settings.nats, "fuzz-gateway", role="gateway")
    gateway = Gateway(settings_for_role(settings, "gateway"), gw_nc)
    await gateway.start()
    conns = {
        role: await connect_nats(settings.nats, f"fuzz-as-{role}", role=role) for role in _ROLES
    }
    http = aiohttp.ClientSession()
    assert stack.leaser and stack.sink and stack.ratelimit
    running = FuzzStack(settings, stack, gateway, conns, http)
    running.responders = {
        "leaser": stack.leaser.responder,
        "sink": stack.sink.responder,
        "ratelimit": stack.ratelimit.responder,
    }
    try:
        yield running
    finally:
        await http.close()
        await gateway.drain(5.0)
        await stack.stop()
        for nc in [gw_nc, *conns.values()]:
            await nc.close()


# --- liveness ---------------------------------------------------------------------


def handler_failures(fuzz: FuzzStack) -> int:
    """Requests the leaser, sink and ratelimit answered ``failed``: their handler raised."""
    return sum(
        n
        for responder in fuzz.responders.values()
        for labels, n in responder.refused.values.items()
        if ("reason", "failed") in labels
    )


async def commits_a_valid_job(fuzz: FuzzStack) -> None:
    """A valid job submitted now is committed: the scheduler, leaser, ratelimit, sink and
    worker all still serve. And no request so far made a handler raise (the stream
    subjects' messages reach the leaser and sink through the worker)."""
    assert handler_failures(fuzz) == 0, "a handler raised on fuzzed input (see the log)"
    fuzz.jobs += 1
    [job] = jobs_for("demo", fuzz.settings, [f"/page/{fuzz.jobs}"])
    job = msgspec.structs.replace(job, id=f"live-{fuzz.jobs}", handler="noop")
    js = fuzz.as_role["client"].jetstream()
    [sent] = await submit_jobs(js, fuzz.settings, "demo", [job])
    assert sent.published and sent.rejection is None, sent

    async def committed() -> bool:
        key = subjects.results("demo").replace(">", "*")
        async for msg in read_stream(fuzz.admin.jetstream(), subjects.STREAM_RESULTS, key):
            if f'"job_id":"{job.id}"'.encode() in msg.data:
                return True
        return False

    await wait_for(committed, SETTLE_S, f"the valid job {job.id} to commit after the fuzz")


# --- request/reply subjects ---------------------------------------------------------


def _ok_refusal(reply: Any) -> str | None:
    return None if reply.ok else reply.detail


def _lease_refusal(reply: Any) -> str | None:
    return f"{reply.reason}: {reply.detail}" if isinstance(reply, LeaseRefusal) else None


def _tagged_refusal(reply: Any) -> str | None:
    if type(reply).__name__ in ("PermitRefused", "PresenceRefused"):
        return f"{reply.reason}: {reply.detail}"
    return None


_SETTLED = {"committed", "suppressed:duplicate-key", "dead-lettered", "kept:malformed-work-order"}


def _sink_refusal(reply: Any) -> str | None:
    return None if reply.status in _SETTLED else f"{reply.status}: {reply.detail}"


@dataclass(frozen=True)
class RequestRoute:
    """One request subject: its types, who may send on it, how a refusal reads."""

    subject: str
    role: Role
    request: Any
    reply: Any
    refusal: Callable[[Any], str | None]
    """The refusal's words, or None when the reply is the handler's yes."""
    service: str
    capped: bool = True
    """Whether the route reads at most ``fleet.max_request_bytes``."""
    overrides: ws.Overrides = field(default_factory=dict)
    probe: Any = None
    """A request its handler must still answer (not a malformed/busy/failed refusal)."""
    tokens: tuple[str, ...] = ()
    """What ``{target}`` in ``subject`` is drawn from (declared, undeclared, invalid)."""

    def subject_for(self, token: str = FUZZ_TARGET) -> str:
        return self.subject.replace("{target}", token)


_NAMES = st.sampled_from(["w-fuzz", "id-fuzz", "eu", "10.9.0.0/24"])
_ON_FUZZ: ws.Overrides = {"target": st.just(FUZZ_TARGET)}
_VALID_VERSIONS = st.fixed_dictionaries({"jetfleet": st.just("0.0.0")}).map(lambda d: d)

REQUEST_ROUTES: tuple[RequestRoute, ...] = (
    RequestRoute(
        subjects.LEASE,
        "worker",
        LeaseCall,
        LeaseReply,
        _lease_refusal,
        "leaser",
        overrides={**_ON_FUZZ, "worker": _NAMES, "pin_identity": st.just("")},
        probe=LeaseRenew(job_id="probe", fence=1),
    ),
    RequestRoute(
        subjects.PRESENCE,
        "worker",
        PresenceWrite,
        PresenceReply,
        _tagged_refusal,
        "leaser",
        capped=False,
    ),
    RequestRoute(
        subjects.PAUSE,
        "operator",
        PauseCommand,
        PauseReply,
        _ok_refusal,
        "leaser",
        overrides={"scope": st.sampled_from(["target", "worker", "identity", "region"])},
        probe=PauseList(),
    ),
    RequestRoute(
        subjects.QUARANTINE,
        "operator",
        QuarantineCommand,
        QuarantineReply,
        _ok_refusal,
        "leaser",
        overrides=_ON_FUZZ,
        probe=QuarantineList(),
    ),
    RequestRoute(
        subjects.QUARANTINE_ANSWER,
        "gateway",
        QuarantineApprove | QuarantineReject,
        QuarantineReply,
        _ok_refusal,
        "leaser",
        probe=QuarantineReject(id="0" * 16),
    ),
    RequestRoute(
        subjects.BREAKER,
        "operator",
        BreakerCommand,
        BreakerReply,
        _ok_refusal,
        "leaser",
        overrides=_ON_FUZZ,
        probe=BreakerList(),
    ),
    RequestRoute(
        subjects.VERSIONS,
        "operator",
        VersionsCommand,
        VersionsReply,
        _ok_refusal,
        "leaser",
        probe=VersionsList(),
    ),
    RequestRoute(
        subjects.RATELIMIT,
        "worker",
        PermitCall,
        RatelimitReply,
        _tagged_refusal,
        "ratelimit",
        overrides=_ON_FUZZ,
        probe=PermitRequest(target=FUZZ_TARGET),
    ),
    RequestRoute(
        subjects.sink_report("{target}"),
        "worker",
        Report,
        SinkReply,
        _sink_refusal,
        "sink",
        capped=False,
        overrides={**_ON_FUZZ, "pin_identity": st.just("")},
        tokens=(FUZZ_TARGET, "demo", "nosuch", "Demo", "_x", "a" * 65),
    ),
)


def _sizes(fuzz_max_request: int, max_payload: int) -> tuple[int, ...]:
    return (fuzz_max_request + 1, 4 * fuzz_max_request, max_payload - 1024)


def route_messages(route: RequestRoute) -> st.SearchStrategy[list[tuple[str, bytes]]]:
    """Batches of (subject, message) for ``route``."""
    # Sizes from the defaults: the fixture's settings keep them (64 KiB, 1 MiB).
    sizes = _sizes(64 * 1024, 1024 * 1024)
    subject = st.sampled_from(route.tokens or (FUZZ_TARGET,)).map(route.subject_for)
    message = ws.message(route.request, route.overrides, sizes)
    return st.lists(st.tuples(subject, message), min_size=1, max_size=BATCH)


async def ask(fuzz: FuzzStack, route: RequestRoute, data: bytes, subject: str = "") -> Any:
    """Send ``data`` on ``route`` as its role; the decoded answer (fails on silence)."""
    nc = fuzz.as_role[route.role]
    subject = subject or route.subject_for()
    try:
        answer = await nc.request(subject, data, timeout=REPLY_TIMEOUT_S)
    except Exception as exc:
        raise AssertionError(
            f"{subject}: no answer to {data[:300]!r} ({len(data)} bytes): {exc!r}"
        ) from exc
    return msgspec.json.decode(answer.data, type=route.reply)


def failed_count(fuzz: FuzzStack, route: RequestRoute) -> int:
    refused = fuzz.responders[route.service].refused
    return sum(n for labels, n in refused.values.items() if ("reason", "failed") in labels)


async def check_request_batch(
    fuzz: FuzzStack, route: RequestRoute, batch: list[tuple[str, bytes]]
) -> None:
    """Each message answered; the undecodable and oversized refused; every refusal with
    a reason; no handler raised; the route's handler still answers."""
    failed_before = failed_count(fuzz, route)
    cap = fuzz.settings.fleet.max_request_bytes if route.capped else 0
    for subject, data in batch:
        reply = await ask(fuzz, route, data, subject)
        words = route.refusal(reply)
        invalid = not ws.decodes(data, route.request) or (cap and len(data) > cap)
        if invalid:
            assert words is not None, f"{subject}: accepted {data[:300]!r}: {reply}"
        if words is not None:
            assert words.strip(" :"), f"{subject}: refused without a reason: {reply}"
    assert failed_count(fuzz, route) == failed_before, (
        f"{route.subject}: a handler raised on fuzzed input (the log has the traceback)"
    )
    if route.probe is not None:
        reply = await ask(fuzz, route, msgspec.json.encode(route.probe))
        words = route.refusal(reply) or ""
        assert not words.startswith(("malformed", "busy", "leaser-error")), reply


async def undo_controls(fuzz: FuzzStack) -> None:
    """Resume every pause, release every quarantine, close every breaker the valid
    commands set, so the next liveness job is granted."""
    nc = fuzz.as_role["operator"]

    async def command(subject: str, body: msgspec.Struct, reply: Any) -> Any:
        answer = await nc.request(subject, msgspec.json.encode(body), timeout=REPLY_TIMEOUT_S)
        return msgspec.json.decode(answer.data, type=reply)

    pauses = await command(subjects.PAUSE, PauseList(), PauseReply)
    for view in pauses.pauses:
        resume = PauseResume(scope=view.record.scope, name=view.record.name, by="fuzz")
        await command(subjects.PAUSE, resume, PauseReply)
    listed = await command(subjects.QUARANTINE, QuarantineList(), QuarantineReply)
    for record in listed.records:
        with contextlib.suppress(msgspec.ValidationError):
            release = msgspec.convert(
                {"scope": record.scope, "name": record.name, "target": record.target},
                QuarantineRelease,
            )
            await command(subjects.QUARANTINE, release, QuarantineReply)
    breakers = await command(subjects.BREAKER, BreakerList(), BreakerReply)
    for view in breakers.breakers:
        with contextlib.suppress(msgspec.ValidationError):
            close = msgspec.convert({"target": view.record.target}, BreakerClose)
            await command(subjects.BREAKER, close, BreakerReply)


def _request_test(route: RequestRoute) -> Any:
    @given(batch=route_messages(route))
    async def test(fuzz: FuzzStack, batch: list[tuple[str, bytes]]) -> None:
        await check_request_batch(fuzz, route, batch)
        await undo_controls(fuzz)

    return test


test_fuzz_lease = _request_test(REQUEST_ROUTES[0])
test_fuzz_presence = _request_test(REQUEST_ROUTES[1])
test_fuzz_pause = _request_test(REQUEST_ROUTES[2])
test_fuzz_quarantine = _request_test(REQUEST_ROUTES[3])
test_fuzz_quarantine_answer = _request_test(REQUEST_ROUTES[4])
test_fuzz_breaker = _request_test(REQUEST_ROUTES[5])
test_fuzz_versions = _request_test(REQUEST_ROUTES[6])
test_fuzz_ratelimit = _request_test(REQUEST_ROUTES[7])
test_fuzz_sink_report = _request_test(REQUEST_ROUTES[8])


async def test_the_request_services_still_commit_a_job_after_the_fuzz(fuzz: FuzzStack) -> None:
    # Runs after the request subjects' tests (file order): whatever they sent, the
    # leaser, ratelimit and sink still carry a job through.
    await undo_controls(fuzz)
    await commits_a_valid_job(fuzz)


# --- jf.submit.<target> -----------------------------------------------------------

_URLS = st.one_of(
    st.from_regex(r"/page/[0-9]{1,4}", fullmatch=True),
    st.sampled_from(["/missing/1", "page/2", "http://elsewhere.invalid/x", "ftp://x/", ""]),
)
JOB_FIELDS: ws.Overrides = {
    "Job.url": _URLS,
    "Job.handler": st.sampled_from(["noop", "http.get"]),
    "Job.pin_identity": st.just(""),
    "Job.pin_region": st.just(""),
    "Job.max_attempts": st.sampled_from([0, 1, 2]),
    "Job.timeout_s": st.sampled_from([0.0, 5.0]),
    "Job.page": st.none(),
}
"""A valid job ends within seconds: no pin nobody owns, few attempts, short timeouts."""

_TOKENS = st.sampled_from(["demo", FUZZ_TARGET, "nosuch", "Demo", "-x", "demo.extra", "_x"])


async def _status_settled(fuzz: FuzzStack, submitted: int | None, unaccounted: int) -> None:
    """Wait until ``submitted`` submissions (None: however many there are) are each in
    exactly one state, none queued or leased. ``unaccounted`` is the count before the
    batch: the work orders fuzzed straight onto work subjects end committed or dead
    without a submission, so the fleet's total is off by them for good, but a batch of
    submissions must not move it."""
    status = None

    async def settled() -> bool:
        nonlocal status
        status = await fuzz.stack.status()
        t = status.totals
        return (
            status.unaccounted == unaccounted
            and status.admitting == 0
            and submitted in (None, t.submitted)
            and t.queued == 0
            and t.leased == 0
        )

    try:
        await wait_for(settled, SETTLE_S, f"{submitted} submissions to settle")
    except AssertionError:
        raise AssertionError(f"not settled: {status}") from None


async def rejections_since(fuzz: FuzzStack, seq: int) -> list[tuple[int, Rejection]]:
    js = fuzz.admin.jetstream()
    return [
        (msg.metadata.sequence.stream, msgspec.json.decode(msg.data, type=Rejection))
        async for msg in read_stream(js, subjects.STREAM_REJECTED, "jf.rejected.>", from_seq=seq)
    ]


async def _rejected_last_seq(fuzz: FuzzStack) -> int:
    info = await fuzz.admin.jetstream().stream_info(subjects.STREAM_REJECTED)
    return info.state.last_seq


def _unique_ids(batch: list[tuple[str, bytes]], start: int) -> list[tuple[str, bytes]]:
    """Valid ids made unique across examples (a repeated id is its own test below)."""
    out = []
    for n, (token, data) in enumerate(batch):
        with contextlib.suppress(ValueError, RecursionError):
            doc = json.loads(data)
            if isinstance(doc, dict) and isinstance(doc.get("id"), str) and ws.decodes(data, Job):
                doc["id"] = f"fz{start + n}-{doc['id']}"[:128].rstrip(".")
                data = ws.encode(doc)
        out.append((token, data))
    return out


@given(
    batch=st.lists(
        st.tuples(_TOKENS, ws.message(Job, JOB_FIELDS, sizes=(70_000, 1024 * 1024 - 1024))),
        min_size=1,
        max_size=BATCH,
    )
)
async def test_fuzz_submit(fuzz: FuzzStack, batch: list[tuple[str, bytes]]) -> None:
    status = await fuzz.stack.status()
    before = status.totals.submitted
    seq = await _rejected_last_seq(fuzz) + 1
    batch = _unique_ids(batch, before)
    js = fuzz.as_role["client"].jetstream()
    for token, data in batch:
        await js.publish(subjects.submit(token), data)
    await _status_settled(fuzz, before + len(batch), status.unaccounted)
    for _, rejection in await rejections_since(fuzz, seq):
        assert rejection.reason and rejection.message, rejection
    await commits_a_valid_job(fuzz)


# --- jf.work.<target>.<tier> ------------------------------------------------------

WORK_FIELDS: ws.Overrides = {
    **JOB_FIELDS,
    "Job.url": st.sampled_from(["http://127.0.0.1:1/x"]),
    "WorkOrder.target": st.sampled_from(["demo", FUZZ_TARGET]),
    "WorkOrder.max_attempts": st.sampled_from([1, 2]),
    "WorkOrder.timeout_s": st.sampled_from([0.5]),
    "WorkOrder.key": st.from_regex(r"x-[0-9a-f]{8}", fullmatch=True),
}


async def _work_messages(fuzz: FuzzStack) -> int:
    info = await fuzz.admin.jetstream().stream_info(subjects.STREAM_WORK)
    return info.state.messages


@given(
    batch=st.lists(
        st.tuples(
            st.sampled_from(["demo", FUZZ_TARGET]),
            st.sampled_from(subjects.TIERS),
            ws.message(WorkOrder, WORK_FIELDS, sizes=(70_000,)),
        ),
        min_size=1,
        max_size=BATCH,
    )
)
@example(
    batch=[
        (
            "demo",
            "normal",
            ws.encode(
                {
                    "job": {
                        "id": f"hostile-key-{n}",
                        "url": "http://127.0.0.1:1/x",
                        "handler": "noop",
                    },
                    "target": "demo",
                    "key": key,
                    "max_attempts": attempts,
                    "timeout_s": 1.0,
                }
            ),
        )
        for n, (key, attempts) in enumerate(
            [("a b", 1), ("*", 1), (">", 1), ("a..b", 1), ("", 1), ("k" * 300, 1), ("x-1", -5)]
        )
    ]
)
async def test_fuzz_work(fuzz: FuzzStack, batch: list[tuple[str, str, bytes]]) -> None:
    seq = await _rejected_last_seq(fuzz) + 1
    js = fuzz.as_role["scheduler"].jetstream()
    expected_kept = 0
    for target, tier, data in batch:
        try:
            order = msgspec.json.decode(data, type=WorkOrder)
        except (msgspec.MsgspecError, RecursionError):
            expected_kept += 1
        else:
            # Runnable only on its own target's subject, with a key the leaser takes.
            bad_key = not ws.decodes(msgspec.json.encode(order.key), IdempotencyKey)
            expected_kept += order.target != target or bad_key
        await js.publish(subjects.work(target, tier), data)

    async def drained() -> bool:
        return await _work_messages(fuzz) == 0

    await wait_for(drained, SETTLE_S, "every fuzzed work order to end (JF_WORK empty)")
    kept = await rejections_since(fuzz, seq)
    assert len(kept) == expected_kept, [r.reason for _, r in kept]
    for _, rejection in kept:
        assert rejection.reason in ("malformed-work-order", "work-order-target-mismatch")
        assert rejection.message, rejection
    await commits_a_valid_job(fuzz)


# --- jf.outcome.<target> (Jf-Job header) ---------------------------------------------

OUTCOME_FIELDS: ws.Overrides = {
    "Outcome.target": st.just(FUZZ_TARGET),
    "Outcome.job_id": st.from_regex(r"[a-z0-9]{1,12}", fullmatch=True),
    "versions": _VALID_VERSIONS,
}


def _outcome_subject(token: str, data: bytes) -> tuple[str, dict[str, str]]:
    """The subject and ``Jf-Job`` header a worker would use for ``data`` (its own target
    and job), or ones made from ``token`` when it names none usable."""
    with contextlib.suppress(msgspec.MsgspecError, RecursionError):
        doc = msgspec.json.decode(data)
        if isinstance(doc, dict):
            target, job = doc.get("target"), doc.get("job_id")
            if all(isinstance(t, str) and ws.is_subject_token(t) for t in (target, job)):
                return subjects.outcomes(str(target)), {JOB_HEADER: str(job)}
    return subjects.outcomes(token), {JOB_HEADER: "job"}


def _quarantine_read(fuzz: FuzzStack) -> int:
    return sum(fuzz.stack.quarantines[0].events.values.values())


@given(
    batch=st.lists(
        st.tuples(_TOKENS, ws.message(Outcome, OUTCOME_FIELDS, sizes=(9000, 200_000))),
        min_size=1,
        max_size=BATCH,
    )
)
async def test_fuzz_outcome(fuzz: FuzzStack, batch: list[tuple[str, bytes]]) -> None:
    js = fuzz.as_role["worker"].jetstream()
    read_before = _quarantine_read(fuzz)
    tail = fuzz.gateway.outcomes
    skipped_before = tail.skipped
    quarantine = fuzz.stack.quarantines[0]
    quarantine_skipped = quarantine.events.get(verdict="skipped")
    refused = 0
    last = 0
    for token, data in batch:
        subject, headers = _outcome_subject(token, data)
        refused += isinstance(read_outcome(subject, data, headers), str)
        last = (await js.publish(subject, data, headers=headers)).seq

    async def read_all() -> bool:
        return _quarantine_read(fuzz) == read_before + len(batch) and tail._last_seq >= last

    await wait_for(read_all, SETTLE_S, "the quarantine service and the gateway to read them all")
    assert tail.skipped - skipped_before == refused
    # The quarantine service skips those too (and names it refuses), each logged.
    assert quarantine.events.get(verdict="skipped") - quarantine_skipped >= refused
    # Still reading: one more valid event is counted.
    event = Outcome(
        job_id="live",
        target=FUZZ_TARGET,
        worker="w-fuzz",
        attempt=1,
        kind="ok",
        duration_s=0.1,
        versions=Versions(jetfleet="0.0.0"),
    )
    await js.publish(
        subjects.outcomes(FUZZ_TARGET), msgspec.json.encode(event), headers={JOB_HEADER: "live"}
    )

    async def counted() -> bool:
        return _quarantine_read(fuzz) == read_before + len(batch) + 1

    await wait_for(counted, SETTLE_S, "a valid outcome event after the fuzz to be read")
    await undo_controls(fuzz)


def _batch_headers(data: bytes) -> dict[str, str]:
    """The ``Jf-Batch`` header a worker would send with ``data`` (its count of events),
    or a count of 1 when it holds no list of events."""
    with contextlib.suppress(msgspec.MsgspecError, RecursionError):
        doc = msgspec.json.decode(data)
        if isinstance(doc, dict) and isinstance(doc.get("events"), list):
            return {BATCH_HEADER: str(len(doc["events"]))}
    return {BATCH_HEADER: "1"}


@given(
    batch=st.lists(
        ws.message(OutcomeBatch, OUTCOME_FIELDS, sizes=(9000, MAX_BATCH_BYTES + 1)),
        min_size=1,
        max_size=BATCH,
    )
)
async def test_fuzz_outcome_batch(fuzz: FuzzStack, batch: list[bytes]) -> None:
    # Batches on the per-target subject: each event in them counted or skipped, once.
    js = fuzz.as_role["worker"].jetstream()
    read_before = _quarantine_read(fuzz)
    tail = fuzz.gateway.outcomes
    skipped_before = tail.skipped
    subject = subjects.outcomes(FUZZ_TARGET)
    items = refused = last = 0
    for data in batch:
        headers = _batch_headers(data)
        read = read_outcomes(subject, data, headers)
        items += len(read)
        refused += sum(isinstance(event, str) for event in read)
        last = (await js.publish(subject, data, headers=headers)).seq

    async def read_all() -> bool:
        return _quarantine_read(fuzz) == read_before + items and tail._last_seq >= last

    await wait_for(read_all, SETTLE_S, "the quarantine service and the gateway to read them all")
    assert tail.skipped - skipped_before == refused
    await undo_controls(fuzz)


# --- max-deliveries advisories ----------------------------------------------------

ADVISORY_FIELDS: ws.Overrides = {
    "MaxDeliveriesAdvisory.stream": st.sampled_from([subjects.STREAM_WORK, "OTHER"]),
    "MaxDeliveriesAdvisory.stream_seq": st.integers(min_value=10**9, max_value=2**62),
}
"""Valid advisories name sequences JF_WORK has never had: a forged one naming a queued
job would end it (only the server and admin may publish advisories)."""


async def _advisory_consumer(fuzz: FuzzStack) -> ConsumerInfo:
    info: ConsumerInfo = await fuzz.admin.jetstream().consumer_info(
        subjects.STREAM_ADVISORIES, subjects.CONSUMER_MAX_DELIVERIES
    )
    return info


@given(
    batch=st.lists(
        ws.message(MaxDeliveriesAdvisory, ADVISORY_FIELDS, sizes=(70_000,)),
        min_size=1,
        max_size=BATCH,
    )
)
@example(
    batch=[
        ws.encode({"stream": "JF_WORK", "consumer": "c", "stream_seq": seq, "deliveries": 1})
        for seq in (-1, 0, 2**63 - 1, 2**63, 2**64 - 1, 10**30)
    ]
)
async def test_fuzz_max_deliveries_advisory(fuzz: FuzzStack, batch: list[bytes]) -> None:
    nc = fuzz.admin
    js = nc.jetstream()
    subject = subjects.max_deliveries_advisories(subjects.STREAM_WORK).replace(">", "work-x")
    last = 0
    for data in batch:
        last = (await js.publish(subject, data)).seq

    async def all_acked() -> bool:
        # The ack floor passes the last one only once every advisory is acked: one the
        # sink naks again and again (a poison message) holds it back.
        info = await _advisory_consumer(fuzz)
        return info.ack_floor is not None and (info.ack_floor.stream_seq or 0) >= last

    await wait_for(all_acked, SETTLE_S, "the sink to settle every fuzzed advisory")


# --- the gateway's POST bodies ------------------------------------------------------

_PAUSE_BODY = st.fixed_dictionaries(
    {},
    optional={
        "scope": st.sampled_from(["target", "worker", "region", "identity", "fleet", "x"]),
        "name": st.one_of(st.just(FUZZ_TARGET), ws.hostile_text()),
        "for": st.one_of(st.sampled_from(["30s", "2h", "-1s", "1e400", "", "nan"]), st.floats()),
        "mode": st.sampled_from(["drain", "now", "later"]),
    },
)
_JOB_LIST = st.lists(ws.valid_json(Job, JOB_FIELDS), max_size=4)
_BODIES = st.one_of(
    _JOB_LIST.map(ws.encode),
    ws.near_valid(Job, JOB_FIELDS),
    ws.garbage(),
    _PAUSE_BODY.map(ws.encode),
)
_HOSTILE_SEGMENTS = ("a*b", "a>b", "a%20b", "a.b", "%00", "%0d%0a", "%E2%80%AE", "x" * 300)
"""Path parameters that must never reach a subject or a KV key as they are."""
_PATHS = st.one_of(
    st.sampled_from(
        [
            "/v1/targets/demo/jobs",
            "/v1/targets/nosuch/jobs",
            "/v1/targets/%2e%2e/jobs",
            "/v1/pause",
            "/v1/resume",
            "/v1/proposals/0000000000000000/approve",
            "/v1/proposals/0000000000000000/reject",
            "/v1/proposals/zz/explode",
            "/v1/dead-letters/nosuch/replay",
        ]
    ),
    st.sampled_from(_HOSTILE_SEGMENTS).flatmap(
        lambda seg: st.sampled_from(
            [
                f"/v1/targets/{seg}/jobs",
                f"/v1/proposals/{seg}/approve",
                f"/v1/proposals/{seg}/reject",
                f"/v1/dead-letters/{seg}/replay",
            ]
        )
    ),
)


@given(
    batch=st.lists(
        st.tuples(_PATHS, _BODIES, st.sampled_from(["application/json", "text/plain"])),
        min_size=1,
        max_size=BATCH,
    )
)
@example(
    batch=[
        (path.format(seg), b'{"why": "x"}', "application/json")
        for seg in _HOSTILE_SEGMENTS
        for path in ("/v1/targets/{}/jobs", "/v1/proposals/{}/reject", "/v1/dead-letters/{}/replay")
    ]
)
async def test_fuzz_gateway_posts(fuzz: FuzzStack, batch: list[tuple[str, bytes, str]]) -> None:
    before = await fuzz.stack.status()
    for path, body, content_type in batch:
        headers = {"Content-Type": content_type, "Authorization": f"Bearer {TOKEN}"}
        async with fuzz.http.post(fuzz.gateway.url + path, data=body, headers=headers) as r:
            text = await r.read()
            assert r.status < 500 or r.status == 503, (path, body[:300], r.status, text[:500])
            if r.content_type != "application/json":
                # aiohttp's own 404 for a path no route matches (``%2e%2e``): text.
                assert r.status == 404 and text, (path, r.status, text[:300])
                continue
            answer = json.loads(text)
            if r.status >= 400 and "rejected" in answer:  # items admission refused
                assert all(i["reason"] and i["message"] for i in answer["rejected"]), answer
            elif r.status >= 400:
                assert answer.get("error"), (path, body[:300], r.status, answer)
    await undo_controls(fuzz)  # a pause (the fleet's, by default) would hold the next job
    # Every item of a jobs body that parsed is published (refused ones too, to be kept on
    # jf.rejected): however many, each settles like those of jf.submit.
    await _status_settled(fuzz, None, before.unaccounted)
    await commits_a_valid_job(fuzz)


# --- the table is complete ----------------------------------------------------------

FUZZED: dict[str, str] = {
    **{route.subject: route.role for route in REQUEST_ROUTES},
    subjects.submit("{target}"): "client",
    subjects.work("{target}", "{tier}"): "scheduler",
    subjects.outcomes("{target}"): "worker",
    subjects.max_deliveries_advisories(subjects.STREAM_WORK): "admin",
}
"""Every consumed subject this module fuzzes, with the role it publishes as."""

NOT_CONSUMED: dict[str, str] = {
    "results": "written only by the sink and the leaser (roles.py), which read back their "
    "own records; clients and tools read the rest",
    "dlq": "written only by the sink and the leaser; a replay goes through jf.submit",
    "duplicates": "written only by the sink and the leaser; read by status",
    "rejected": "written only by the scheduler and the sink; read by tools and clients",
    "alert": "kept for operators; no service reads it",
    "versions-alert": "kept for operators; no service reads it",
    "audit": "written by the leaser and operator tools; read by `jetfleet audit`",
}
"""Catalogue stream channels no service or worker consumes, and why."""


def _served_subjects(fuzz: FuzzStack) -> set[str]:
    served = set()
    for responder in fuzz.responders.values():
        served |= {s.replace("*", "{target}") for s in responder.subjects}
    return served


async def test_every_consumed_subject_is_fuzzed(fuzz: FuzzStack) -> None:
    served = _served_subjects(fuzz)
    assert served, "no responder subjects found"
    missing = served - FUZZED.keys()
    assert not missing, f"served but not fuzzed (add them to REQUEST_ROUTES): {missing}"
    for channel in CHANNELS:
        if channel.kind == "request":
            assert channel.address in FUZZED, f"request channel {channel.name} is not fuzzed"
        elif channel.kind == "stream" and channel.address not in FUZZED:
            assert channel.name in NOT_CONSUMED, (
                f"stream channel {channel.name} ({channel.address}) is neither fuzzed nor "
                "listed in NOT_CONSUMED with the reason no service consumes it"
            )
