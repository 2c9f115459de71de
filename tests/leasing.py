"""Work orders, lease requests and sink reports made by hand, for the lease tests (the
real leaser and sink answer them over NATS)."""

from __future__ import annotations

import msgspec
from jetfleet.schemas import (
    AttemptRecord,
    Failure,
    Job,
    LeaseGrant,
    LeaseRefusal,
    LeaseRequest,
    NoopOutput,
    SinkReply,
    Success,
    Versions,
    WorkOrder,
)
from nats.aio.client import Client as NatsClient

import jetfleet
from jetfleet import subjects
from jetfleet.admission import admit
from jetfleet.client import new_job_id, resolve_url
from jetfleet.lease_client import LeaseClient
from jetfleet.settings import Settings

VERSIONS = Versions(jetfleet=jetfleet.__version__, handler="noop@1")
_encoder = msgspec.json.Encoder()


def order_for(settings: Settings, path: str, target: str = "demo", **fields: object) -> WorkOrder:
    job = msgspec.convert(
        {
            "id": new_job_id(),
            "url": resolve_url(settings, target, path),
            "handler": "noop",
            **fields,
        },
        Job,
    )
    order = admit(subjects.submit(target), _encoder.encode(job), settings)
    assert isinstance(order, WorkOrder), order
    return order


def ask(
    order: WorkOrder,
    worker: str = "w-a",
    identity: str = "",
    reply_subject: str = "",
    job_id: str | None = None,
    sends_request: bool = False,
) -> LeaseRequest:
    """A lease request as a worker sends it: ``sends_request`` false, the worker takes its
    own permits (true: as a worker from before that asked, the grant takes one)."""
    return LeaseRequest(
        job_id=job_id or order.job.id,
        target=order.target,
        key=order.key,
        worker=worker,
        versions=VERSIONS,
        identity=identity,
        reply_subject=reply_subject,
        pin_identity=order.job.pin_identity,
        sends_request=sends_request,
    )


async def granted(client: LeaseClient, request: LeaseRequest) -> LeaseGrant:
    reply = await client.grant(request)
    assert isinstance(reply, LeaseGrant), reply
    return reply


async def refused(client: LeaseClient, request: LeaseRequest) -> LeaseRefusal:
    reply = await client.grant(request)
    assert isinstance(reply, LeaseRefusal), reply
    return reply


async def report(nc: NatsClient, order: WorkOrder, fence: int, worker: str) -> SinkReply:
    success = Success(
        order=order,
        worker=worker,
        attempt=1,
        duration_s=0.01,
        output=NoopOutput(),
        versions=VERSIONS,
        fence=fence,
    )
    return await _send(nc, order, success)


async def report_failure(
    nc: NatsClient, order: WorkOrder, fence: int, worker: str, reason: str = "not-found"
) -> SinkReply:
    """Report a permanent failure of the job's first attempt: the sink dead-letters it."""
    attempt = AttemptRecord(
        attempt=1, worker=worker, fence=fence, outcome="permanent", reason=reason
    )
    failure = Failure(
        order=order,
        worker=worker,
        reason=reason,
        history=[attempt],
        versions=VERSIONS,
        fence=fence,
    )
    return await _send(nc, order, failure)


async def _send(nc: NatsClient, order: WorkOrder, report: Success | Failure) -> SinkReply:
    answer = await nc.request(
        subjects.sink_report(order.target), _encoder.encode(report), timeout=5.0
    )
    return msgspec.json.decode(answer.data, type=SinkReply)


async def grant_fence(client: LeaseClient, order: WorkOrder, worker: str) -> int:
    """Grant ``order`` to ``worker``; its fence."""
    return (await granted(client, ask(order, worker))).fence
