"""Bad sink reports on the real sink (issue 8 item 10): a report wrong in itself is
answered ``error`` with what is wrong, and nothing is committed or dead-lettered for it;
a report on a target the sink does not declare is answered ``busy`` (the job is healthy,
the sink's settings lag), and committed once a sink that declares the target takes it.
Either way the lease stays, and the right report right after is served."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from jetfleet.schemas import (
    AttemptRecord,
    Failure,
    NoopOutput,
    SinkReply,
    Success,
    WorkOrder,
)
from jetfleet.services.sink import Sink
from jetfleet.services.sink.report_checks import UNDECLARED_RETRY_S
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.connection import connect_nats
from jetfleet.lease_client import LeaseClient
from jetfleet.lease_store import LeaseStore
from jetfleet.settings import Settings
from jetfleet.simulator import TargetSimulator
from tests.conftest import make_settings, sim_target
from tests.leasing import VERSIONS, ask, granted, order_for
from tests.stack import InProcessStack

_reply = msgspec.json.Decoder(SinkReply)


@pytest.fixture
def settings(nats_url: str, redis_url: str, simulator: TargetSimulator) -> Settings:
    target = sim_target(simulator)
    return make_settings(nats_url, redis_url, {"demo": target, "other": target})


def _success(order: WorkOrder, fence: int) -> Success:
    return Success(
        order=order,
        worker="w-a",
        attempt=1,
        duration_s=0.01,
        output=NoopOutput(),
        versions=VERSIONS,
        fence=fence,
    )


def _failure(order: WorkOrder, fence: int, history: int = 1) -> Failure:
    record = AttemptRecord(attempt=1, worker="w-a", fence=fence, outcome="permanent")
    return Failure(
        order=order,
        worker="w-a",
        reason="not-found",
        history=[record] * history,
        versions=VERSIONS,
        fence=fence,
    )


async def _send(nc: NatsClient, subject: str, report: object) -> SinkReply:
    payload = msgspec.json.encode(report)
    return _reply.decode((await nc.request(subject, payload, timeout=5.0)).data)


async def _stored(nc: NatsClient, stream: str) -> int:
    return (await nc.jetstream().stream_info(stream)).state.messages


def _changed(report: Success | Failure, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = msgspec.to_builtins(report)
    for path, value in fields.items():
        *outer, leaf = path.split("__")
        part = body
        for name in outer:
            part = part[name]
        part[leaf] = value
    return body


# (what is wrong, report kind, the subject's target, the change, what the detail names)
WRONG = [
    ("sent on another target", "success", "other", {}, "send it on jf.sink.report.demo"),
    ("order for another target", "success", "demo", {"order__target": "other"}, "send it on"),
    ("wildcard key", "success", "demo", {"order__key": ">"}, "order.key"),
    ("worker with a line break", "success", "demo", {"worker": "w\nX"}, "$.worker"),
    ("identity too long", "success", "demo", {"identity": "i" * 300}, "$.identity"),
    ("history over 1000 attempts", "failure-long", "demo", {}, "$.history"),
    ("reason with a line break", "failure", "demo", {"reason": "x\r\nJf-Job: y"}, "$.reason"),
]


@pytest.mark.parametrize(
    ("kind", "sent_on", "change", "hint"), [w[1:] for w in WRONG], ids=[w[0] for w in WRONG]
)
async def test_item10_a_report_wrong_in_itself_is_an_error_and_nothing_is_settled(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    store: LeaseStore,
    kind: str,
    sent_on: str,
    change: dict[str, Any],
    hint: str,
) -> None:
    order = order_for(settings, "/page/1")
    fence = (await granted(LeaseClient(nc), ask(order))).fence
    good: Success | Failure = (
        _success(order, fence) if kind == "success" else _failure(order, fence)
    )
    bad = _failure(order, fence, history=1001) if kind == "failure-long" else good
    subject = subjects.sink_report(sent_on)

    reply = await _send(nc, subject, _changed(bad, **change))
    assert reply.status == "error", reply
    assert hint in reply.detail, reply.detail
    assert (await _stored(nc, subjects.STREAM_RESULTS), await _stored(nc, subjects.STREAM_DLQ)) == (
        0,
        0,
    ), "nothing may be committed or dead-lettered for a refused report"
    live = await store.live(order.job.id)
    assert live is not None and live.fence == fence
    assert (await store.read_history(order.job.id)).history.settled is None  # type: ignore[union-attr]

    # The right report right after is served.
    settled = await _send(nc, subjects.sink_report("demo"), good)
    assert settled.status == ("committed" if kind == "success" else "dead-lettered"), settled


async def test_item10_a_report_on_a_target_the_sink_does_not_declare_is_busy_not_an_error(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    # Only a sink whose settings lag (no target "other") answers: the stack's is drained.
    assert services.sink is not None
    await services.sink.drain(5.0)
    lagging = msgspec.structs.replace(settings, targets={"demo": settings.targets["demo"]})
    connection = await connect_nats(settings.nats, "lagging-sink")
    try:
        sink = Sink(lagging, connection)
        await sink.start()
        order = order_for(settings, "/page/2", target="other")
        grant = await granted(LeaseClient(nc), ask(order))
        report = _success(order, grant.fence)

        reply = await _send(nc, subjects.sink_report("other"), report)
        # Busy: the worker sends the same report again, renewing its lease, and spends no
        # attempt; an error would have it run the job again, up to its attempts.
        assert (reply.status, reply.retry_after_s) == ("busy", UNDECLARED_RETRY_S), reply
        assert "[targets.other]" in reply.detail and "restart it" in reply.detail, reply.detail
        assert await _stored(nc, subjects.STREAM_RESULTS) == 0
        assert (await store.highest_fence(order.job.id)).grants == 1

        # A sink that declares the target takes the same report.
        await sink.drain(5.0)
        await services.start_sink()
        assert (await _send(nc, subjects.sink_report("other"), report)).status == "committed"
        assert (await store.highest_fence(order.job.id)).grants == 1
    finally:
        await connection.close()
