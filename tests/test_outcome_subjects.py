"""Outcome events live on one subject per target (docs/scale.md, "Subject state", item 1):
many jobs, committed, retried and dead-lettered, leave JF_OUTCOMES with one subject per
target, each event naming its job in the ``Jf-Job`` header; real workers, leaser, sink."""

from __future__ import annotations

import json

import pytest
from jetfleet.schemas import Outcome
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.outcome_events import BATCH_HEADER, JOB_HEADER, read_outcomes
from jetfleet.settings import Settings
from jetfleet.simulator import TargetSimulator
from jetfleet.stream_reader import read_stream
from tests.conftest import make_settings, sim_target, wait_for
from tests.queueing.helpers import committed, dead, submit_paths
from tests.stack import InProcessStack

TARGETS = ("shop", "news")
JOBS_PER_TARGET = 60


@pytest.fixture
def settings(nats_url: str, redis_url: str, simulator: TargetSimulator) -> Settings:
    return make_settings(nats_url, redis_url, dict.fromkeys(TARGETS, sim_target(simulator)))


async def test_many_jobs_leave_one_outcome_subject_per_target(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    await services.add_worker("w-0")
    await services.add_worker("w-1")
    js = nc.jetstream()
    # Per target: pages that commit, pages that fail for good on the first attempt, and
    # pages that fail every attempt (retried, then dead-lettered).
    kinds = ("/page/{n}", "/missing/{n}", "/error/{n}")
    for t, name in enumerate(TARGETS):
        # Distinct URLs per target: the same work on two targets would share its key.
        paths = [kinds[n % 3].format(n=1000 * t + n) for n in range(JOBS_PER_TARGET)]
        await submit_paths(js, settings, name, paths, name)

    async def all_settled() -> bool:
        for name in TARGETS:
            if await committed(js, name) + await dead(js, name) < JOBS_PER_TARGET:
                return False
        return True

    await wait_for(all_settled, 90.0, "every job committed or dead-lettered")
    budget = settings.targets["shop"].max_attempts
    expected = {
        f"{name}-{n}": budget if n % 3 == 2 else 1
        for name in TARGETS
        for n in range(JOBS_PER_TARGET)
    }
    ran: dict[str, int] = {}

    async def every_attempt_stored() -> bool:
        # A worker holds its ok events up to 50 ms for a batch: they may land after
        # the commit.
        ran.clear()
        async for msg in read_stream(js, subjects.STREAM_OUTCOMES, "jf.outcome.>"):
            events = read_outcomes(msg.subject, msg.data, msg.headers)
            headers = msg.headers or {}
            if BATCH_HEADER in headers:
                assert int(headers[BATCH_HEADER]) == len(events) > 1
                assert all(isinstance(e, Outcome) and e.kind == "ok" for e in events)
            else:
                assert [headers[JOB_HEADER]] == [getattr(e, "job_id", e) for e in events]
            for event in events:
                assert isinstance(event, Outcome), event
                ran[event.job_id] = ran.get(event.job_id, 0) + 1
        return set(ran) == set(expected)

    await wait_for(every_attempt_stored, 30.0, "every job's outcome events")
    # num_subjects as `nats stream info` shows it (nats-py's StreamState drops it).
    answer = await nc.request(f"$JS.API.STREAM.INFO.{subjects.STREAM_OUTCOMES}", b"", timeout=5)
    assert json.loads(answer.data)["state"]["num_subjects"] == len(TARGETS)
    info = await js.stream_info(subjects.STREAM_OUTCOMES, subjects_filter=">")
    assert set(info.state.subjects or {}) == {subjects.outcomes(name) for name in TARGETS}
    # Every job's attempts are there: each job ran, the failing ones every attempt of
    # their budget (a lease lost on a loaded machine adds an attempt, never removes one).
    assert all(ran[job] >= runs for job, runs in expected.items()), ran
