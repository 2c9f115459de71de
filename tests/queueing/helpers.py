"""Settings, a timing handler and counters shared by the queueing tests.

``queueing.timed`` is ``http.get`` (so the request really goes to the simulator) with the
start and end of every attempt noted in ``TIMINGS``, keyed by job id, on this process's
clock. Importing this module registers it; jobs may use it when the settings list it in
``fleet.handlers`` (``queue_settings`` does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
from jetfleet.schemas import HandlerOutput, Job, Outcome
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.client import resolve_url, submit_jobs
from jetfleet.outcome_events import read_outcomes
from jetfleet.settings import Settings, TargetSettings, WorkerSettings
from jetfleet.stream_reader import count_messages, read_stream
from jetfleet.worker import HandlerContext, handler
from jetfleet.worker.builtin import http_get
from tests.conftest import ROBOTS_OFF_REASON, make_settings

TIMED_HANDLER = "queueing.timed"


@dataclass
class Attempt:
    """One run of ``queueing.timed``: which job, its tier, when it started and ended."""

    job_id: str
    tier: str
    worker: str
    start: float
    end: float | None = None


@dataclass
class Timings:
    """Every attempt of ``queueing.timed`` in this process, in start order."""

    attempts: list[Attempt] = field(default_factory=list)

    def clear(self) -> None:
        self.attempts.clear()

    def started(self, tier: str | None = None) -> list[Attempt]:
        return [a for a in self.attempts if tier is None or a.tier == tier]

    def first_start(self, job_id: str) -> float | None:
        starts = [a.start for a in self.attempts if a.job_id == job_id]
        return min(starts) if starts else None

    def running(self, tier: str | None = None) -> int:
        return sum(1 for a in self.started(tier) if a.end is None)

    def finished(self, tier: str | None = None) -> int:
        return sum(1 for a in self.started(tier) if a.end is not None)


TIMINGS = Timings()


@handler(TIMED_HANDLER)
async def timed(ctx: HandlerContext) -> HandlerOutput:
    """``http.get``, timed."""
    attempt = Attempt(ctx.order.job.id, ctx.order.job.tier, ctx.worker_id, time.monotonic())
    TIMINGS.attempts.append(attempt)
    try:
        return await http_get(ctx)
    finally:
        attempt.end = time.monotonic()


def queue_settings(
    nats_url: str,
    redis_url: str,
    targets: dict[str, TargetSettings],
    concurrency: int,
    **fleet: object,
) -> Settings:
    """The tests' usual fast settings, with this worker concurrency and the timed handler."""
    base = make_settings(nats_url, redis_url, targets, **fleet)
    return msgspec.structs.replace(
        base,
        worker=WorkerSettings(concurrency=concurrency),
        fleet=msgspec.structs.replace(base.fleet, handlers=(TIMED_HANDLER,)),
    )


def target(base_url: str, **overrides: object) -> TargetSettings:
    """A target on a simulator, generous caps unless overridden."""
    values: dict[str, object] = {
        "base_url": base_url.rstrip("/") + "/",
        "rate": 1000.0,
        "burst": 100,
        "max_in_flight": 64,
        "timeout_s": 5.0,
        "obey_robots": False,
        "robots_off_reason": ROBOTS_OFF_REASON,
    }
    values.update(overrides)
    return TargetSettings(**values)  # type: ignore[arg-type]


async def committed(js: JetStreamContext, target_name: str) -> int:
    """Committed results of one target (durable state, not worker counters)."""
    return await count_messages(js, subjects.STREAM_RESULTS, subjects.results(target_name))


async def dead(js: JetStreamContext, target_name: str) -> int:
    """Dead letters of one target."""
    return await count_messages(js, subjects.STREAM_DLQ, subjects.dlq(target_name))


async def outcomes(js: JetStreamContext, target_name: str) -> list[Outcome]:
    """Every stored outcome event of one target, of either subject form (per target with
    the job in ``Jf-Job``, and the old per-job one), read as the product reads them
    (``read_outcomes``): an event it would skip fails the test."""
    events = []
    for filter_subject in subjects.outcome_filters(target_name):
        async for msg in read_stream(js, subjects.STREAM_OUTCOMES, filter_subject):
            for event in read_outcomes(msg.subject, msg.data, msg.headers):
                assert not isinstance(event, str), f"{msg.subject}: {event}"
                events.append(event)
    return events


async def delivered(js: JetStreamContext, target_name: str) -> int:
    """How many deliveries (first ones and redeliveries) the target's work consumers
    have made, all tiers together: it grows only while somebody pulls the target."""
    total = 0
    for tier in subjects.TIERS:
        info = await js.consumer_info(
            subjects.STREAM_WORK, subjects.work_consumer(target_name, tier)
        )
        total += info.delivered.consumer_seq or 0
    return total


async def submit_paths(
    js: JetStreamContext,
    settings: Settings,
    target_name: str,
    paths: list[str],
    prefix: str,
    **fields: object,
) -> list[Job]:
    """One job per path (ids ``<prefix>-<n>``, with ``fields``), submitted; fails the test
    unless every one is published and admitted."""
    jobs = [
        msgspec.convert(
            {"id": f"{prefix}-{n}", "url": resolve_url(settings, target_name, path), **fields},
            Job,
        )
        for n, path in enumerate(paths)
    ]
    results = await submit_jobs(js, settings, target_name, jobs)
    assert all(r.published and r.rejection is None for r in results), results[:3]
    return jobs
