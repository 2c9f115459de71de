"""The sink's backstop (services/sink/exhausted.py) ends a job whose deliveries ran out
with a dead letter: that end is a span in the job's own trace, parented on the submit
span the work order carries. Real nats-server and redis-server, the services and a
worker in this process, spans exported over OTLP/HTTP to a receiver here."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from jetfleet import tracing
from jetfleet.client import jobs_for, submit_jobs
from jetfleet.simulator import TargetSimulator
from tests.conftest import wait_for
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.test_unrunnable import NOBODY, pages, running, unrunnable_settings, wait_dead

pytestmark = pytest.mark.timeout(180)

BACKSTOP_SPAN = "backstop dead letter"


@pytest.fixture
async def receiver() -> Iterator[OtlpReceiver]:  # type: ignore[misc]
    found = OtlpReceiver()
    await found.start()
    try:
        yield found
    finally:
        await found.stop()


def named(spans: list[ReceivedSpan], name: str, job_id: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name and s.attribute("jetfleet.job.id") == job_id]


async def test_the_backstops_dead_letter_is_a_span_in_the_jobs_trace(
    nats_url: str,
    redis_url: str,
    simulator: TargetSimulator,
    receiver: OtlpReceiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    settings = unrunnable_settings(nats_url, redis_url, simulator)
    assert tracing.setup_tracing("test", os.environ) is not None
    try:
        async with running(settings, workers=1) as stack:
            nc = stack.connections[0]
            [job] = jobs_for("demo", settings, pages(1), pin_identity=NOBODY)
            await submit_jobs(nc.jetstream(), settings, "demo", [job])
            await wait_dead(nc, [job.id], 60, "the pinned job's dead letter")

            async def exported() -> bool:
                return bool(named(receiver.spans, BACKSTOP_SPAN, job.id))

            await wait_for(exported, 30, "the backstop's span")
    finally:
        tracing.shutdown_tracing()

    [submit] = named(receiver.spans, "send jf.submit.demo", job.id)
    [ended] = named(receiver.spans, BACKSTOP_SPAN, job.id)
    assert ended.trace_id == submit.trace_id and ended.parent_id == submit.span_id
    assert ended.attribute("jetfleet.outcome") == "dead-lettered"
    assert ended.attribute("jetfleet.reason") == "no-eligible-worker"
    assert ended.attribute("jetfleet.target") == "demo"
    assert isinstance(ended.attribute("jetfleet.deliveries"), int)
    handed_back = [
        s
        for s in receiver.trace(submit.trace_id)
        if s.name == "process jf.work.demo.normal" and s.parent_id == submit.span_id
    ]
    assert handed_back, "the deliveries before it are in the same trace"
