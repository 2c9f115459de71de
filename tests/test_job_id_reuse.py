"""Item 1 of issue 8: a job id submitted again is refused while the first job's state
lives, the same way whichever entry point it came by, and status stays conserved.

A second submission must get past the stream's duplicate window (120 s) to show the
reuse; the tests publish the first one under another ``Nats-Msg-Id`` than the entry point
uses, so the second is stored in JF_SUBMIT and reaches admission at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import msgspec
import pytest
from jetfleet.schemas import Job, Rejection
from jetfleet.services.gateway import Gateway
from jetfleet.services.scheduler import Scheduler
from jetfleet.services.scheduler.job_ids import DUPLICATE_JOB_ID
from nats.aio.client import Client as NatsClient
from nats.js import api as js_api

from jetfleet import subjects
from jetfleet.client import submit_jobs
from jetfleet.connection import connect_nats
from jetfleet.ops.status import FleetStatus
from jetfleet.settings import GatewaySettings, Settings
from jetfleet.simulator import TargetSimulator
from jetfleet.stream_reader import read_stream
from tests.conftest import wait_for
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(60)
_encoder = msgspec.json.Encoder()
_rejection = msgspec.json.Decoder(Rejection)

Resubmit = Callable[[Settings, NatsClient, Job], Awaitable[None]]


async def _raw_publish(settings: Settings, nc: NatsClient, job: Job) -> None:
    # Any NATS client, any language: no message id at all.
    await nc.jetstream().publish(subjects.submit("demo"), _encoder.encode(job))


async def _jetfleet_submit(settings: Settings, nc: NatsClient, job: Job) -> None:
    [result] = await submit_jobs(nc.jetstream(), settings, "demo", [job])
    assert result.published and result.rejection is None, result


async def _http_api(settings: Settings, nc: NatsClient, job: Job) -> None:
    own = msgspec.structs.replace(settings, gateway=GatewaySettings(port=0))
    conn = await connect_nats(settings.nats, "gateway")
    gateway = Gateway(own, conn)
    await gateway.start()
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{gateway.url}/v1/targets/demo/jobs", data=_encoder.encode(job)) as resp,
        ):
            assert resp.status < 300, await resp.text()
    finally:
        await gateway.drain(5.0)
        await conn.close()


async def _rejections(nc: NatsClient) -> list[Rejection]:
    stream = read_stream(nc.jetstream(), subjects.STREAM_REJECTED, "jf.rejected.>")
    return [_rejection.decode(msg.data) async for msg in stream]


def _settled(status: FleetStatus, committed: int = 0, dead: int = 0, rejected: int = 0) -> bool:
    totals = status.totals
    return (totals.committed, totals.dead, totals.rejected) == (committed, dead, rejected) and (
        status.conserved and totals.queued == totals.leased == 0
    )


@pytest.mark.parametrize(
    "resubmit", [_raw_publish, _jetfleet_submit, _http_api], ids=["raw", "submit", "http"]
)
@pytest.mark.parametrize("first_ends", ["committed", "dead"])
async def test_item1_a_job_id_submitted_again_is_refused_as_duplicate_job_id(
    settings: Settings,
    nc: NatsClient,
    stack: InProcessStack,
    simulator: TargetSimulator,
    resubmit: Resubmit,
    first_ends: str,
) -> None:
    """The first job under an id runs and ends; the same id submitted again must not
    inherit its grants, seal or dead letter (acked unrun as done, or terminated with no
    letter of its own), nor vanish: it is refused on jf.rejected with its reason, and
    every submission is accounted for."""
    path = "/page/71" if first_ends == "committed" else "/missing/72"
    first = Job(id="daily-recrawl-1", url=simulator.base_url + path)
    # The first submission under a message id of its own: the entry points' dedupe
    # (`sub-<id>`, 120 s) does not hide the second one.
    await nc.jetstream().publish(
        subjects.submit("demo"), _encoder.encode(first), headers={"Nats-Msg-Id": "first-run"}
    )
    counts = {"committed": int(first_ends == "committed"), "dead": int(first_ends == "dead")}
    await wait_for(lambda: _ended(stack, **counts), 20.0, f"the first job to end {first_ends}")
    requests = simulator.counts()["total"]

    again = Job(id=first.id, url=simulator.base_url + "/page/73")
    await resubmit(settings, nc, again)
    await wait_for(
        lambda: _ended(stack, rejected=1, **counts), 20.0, "the second submission refused"
    )
    [refused] = await _rejections(nc)
    assert (refused.reason, refused.job_id) == (DUPLICATE_JOB_ID, first.id)
    assert "new job id" in refused.message
    assert msgspec.json.decode(refused.raw, type=Job) == again
    status = await stack.status()
    assert status.totals.submitted == 2 and status.conserved, status
    assert simulator.counts()["total"] == requests, "the refused job reached the target"


async def _ended(stack: InProcessStack, **counts: int) -> bool:
    return _settled(await stack.status(), **counts)


@pytest.fixture
async def submitted_then_restarted(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> AsyncIterator[int]:
    """A job admitted, then its submission delivered again to a restarted scheduler (as
    if the first had died before its ack): yields the submission's sequence."""
    job = Job(id="restart-1", url=settings.targets["demo"].base_url + "page/74")
    ack = await nc.jetstream().publish(subjects.submit("demo"), _encoder.encode(job))
    assert services.scheduler is not None
    await wait_for(lambda: _routed(nc), 20.0, "the job routed to its work subject")
    await services.scheduler.drain(5.0)
    js = nc.jetstream()
    await js.delete_consumer(subjects.STREAM_SUBMIT, subjects.CONSUMER_SCHEDULER)
    await js.add_consumer(
        subjects.STREAM_SUBMIT,
        js_api.ConsumerConfig(
            durable_name=subjects.CONSUMER_SCHEDULER,
            ack_policy=js_api.AckPolicy.EXPLICIT,
            ack_wait=30.0,
            deliver_policy=js_api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=ack.seq,
        ),
    )
    again = Scheduler(settings, await connect_nats(settings.nats, "scheduler-again"))
    await again.start()
    yield ack.seq
    await again.drain(5.0)
    await again.nc.close()


async def _routed(nc: NatsClient) -> bool:
    info = await nc.jetstream().stream_info(subjects.STREAM_WORK)
    return info.state.messages == 1


async def test_item1_a_scheduler_restarting_mid_batch_admits_its_own_submission_again(
    nc: NatsClient, services: InProcessStack, submitted_then_restarted: int
) -> None:
    """The same submission admitted twice is one job, not a duplicate of itself."""
    js = nc.jetstream()

    async def readmitted() -> bool:
        info = await js.consumer_info(subjects.STREAM_SUBMIT, subjects.CONSUMER_SCHEDULER)
        return info.delivered.stream_seq >= submitted_then_restarted and not (
            info.num_ack_pending or info.num_pending
        )

    await wait_for(readmitted, 20.0, "the restarted scheduler to admit the submission again")
    assert await _rejections(nc) == []
    info = await js.stream_info(subjects.STREAM_WORK)
    assert info.state.messages == 1, "routed twice"
    status = await services.status()
    assert status.totals.submitted == 1 and status.conserved, status
