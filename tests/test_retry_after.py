"""Issue 8 item 4: Retry-After is bounded per target and its HTTP-date form is parsed.

A target answering ``Retry-After: 100000000`` must not park a job for three years nor stop
the worker pulling it for that long: the wait is cut to the target's
``max_retry_after_s``, the job comes back after the cap, and the longer ask shows as a
target hold on the worker's ``/metrics``. An HTTP-date is measured against the response's
own ``Date`` (the target's clock), never the worker's.

Real servers: a fresh nats-server, the target simulator (which counts every request on
arrival), scheduler + leaser + sink + one worker in this process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from jetfleet.schemas import Outcome
from nats.js import JetStreamContext

from jetfleet.errors import ConfigError
from jetfleet.metrics import ServiceMeters
from jetfleet.settings import Settings, load_settings
from jetfleet.simulator import SimulatorConfig, TargetSimulator
from jetfleet.worker import Worker
from jetfleet.worker.retry_after import retry_after_s
from tests.conftest import wait_for
from tests.prom_text import value
from tests.queueing.helpers import dead, outcomes, queue_settings, submit_paths, target
from tests.stack import InProcessStack

CAP_S = 2.0
THREE_YEARS_S = 100_000_000


@dataclass
class Env:
    stack: InProcessStack
    settings: Settings
    js: JetStreamContext
    sim: TargetSimulator

    @property
    def worker(self) -> Worker:
        return self.stack.workers[0]

    async def outcomes(self) -> list[Outcome]:
        return await outcomes(self.js, "slow")


async def start_env(
    nats_url: str, redis_url: str, sim: TargetSimulator, **overrides: object
) -> Env:
    targets = {"slow": target(sim.base_url, **overrides)}
    settings = queue_settings(nats_url, redis_url, targets, concurrency=2)
    stack = InProcessStack(settings)
    await stack.start(workers=1)
    return Env(stack, settings, stack.connections[0].jetstream(), sim)


@pytest.fixture
async def sim() -> AsyncIterator[TargetSimulator]:
    async with TargetSimulator(SimulatorConfig()) as running:
        yield running


async def test_item4_a_three_year_retry_after_is_cut_to_the_cap_and_shown_as_a_target_hold(
    nats_url: str, redis_url: str, sim: TargetSimulator
) -> None:
    env = await start_env(nats_url, redis_url, sim, max_retry_after_s=CAP_S)
    try:
        await submit_paths(
            env.js, env.settings, "slow", [f"/ratelimited/0?retry_after={THREE_YEARS_S}"], "ra"
        )

        async def asked_three_times() -> bool:
            return int(sim.counts()["total"]) >= 3

        # Uncapped, the job and the target would stay away for three years: the second
        # request would never come.
        await wait_for(asked_three_times, 10 * CAP_S + 20, "the job to come back after the cap")
        # Still polite: one probe per cap, never a flood.
        assert sim.max_in_any_window(CAP_S - 0.3) <= 1, sim.counts()
        holds = env.worker.holds
        assert holds.held("slow") == THREE_YEARS_S
        assert holds.count.get(worker=env.worker.worker_id, target="slow") >= 2
        shown = ServiceMeters("worker", env.worker.metrics).render().decode()
        asked = "jetfleet_worker_target_hold_asked_seconds"
        assert value(shown, asked, target="slow", worker=env.worker.worker_id), shown
        blocked = [o for o in await env.outcomes() if o.kind == "blocked"]
        assert blocked and all("max_retry_after_s" in o.detail for o in blocked), blocked
        assert await dead(env.js, "slow") == 0  # blocked attempts are refunded
    finally:
        await env.stack.stop()


async def test_item4_an_http_date_retry_after_is_measured_against_the_targets_own_date(
    nats_url: str, redis_url: str, sim: TargetSimulator
) -> None:
    # The target's clock runs an hour ahead of ours. Measured against the worker's clock
    # its "retry at" would mean an hour (cut to the 300 s default cap); against its own
    # Date it means 2 s. Unparsed, the policy's 0.2 s backoff would apply instead.
    env = await start_env(nats_url, redis_url, sim)
    try:
        path = "/ratelimited/0?retry_at=2&date_skew=3600"
        await submit_paths(env.js, env.settings, "slow", [path], "date")

        async def asked_twice() -> bool:
            return int(sim.counts()["total"]) >= 2

        await wait_for(asked_twice, 30, "the job to come back after the target's 2 s")
        assert sim.max_in_any_window(1.7) <= 1, "came back sooner than the target asked"
        assert env.worker.holds.held("slow") is None
    finally:
        await env.stack.stop()


def test_item4_retry_after_reads_seconds_and_dates_and_refuses_what_it_cannot_measure() -> None:
    date = "Tue, 01 Dec 2026 07:00:00 GMT"
    assert retry_after_s("120", None) == 120.0
    assert retry_after_s(" 7 ", None) == 7.0
    assert retry_after_s("Tue, 01 Dec 2026 07:01:30 GMT", date) == 90.0
    assert retry_after_s("Tue, 01 Dec 2026 06:59:00 GMT", date) == 0.0  # already past
    # A date with nothing of the target's own to measure it from is not guessed at.
    assert retry_after_s("Tue, 01 Dec 2026 07:01:30 GMT", None) is None
    assert retry_after_s("soon", date) is None
    assert retry_after_s("inf", date) is None
    assert retry_after_s(None, date) is None


@pytest.mark.parametrize("value", ["0", "0.5", "86401"])
def test_item4_max_retry_after_s_out_of_range_is_refused_naming_the_key(
    tmp_path: Path, value: str
) -> None:
    path = tmp_path / "jetfleet.toml"
    path.write_text(
        f'[targets.demo]\nbase_url = "https://example.org/"\nmax_retry_after_s = {value}\n'
    )
    with pytest.raises(ConfigError) as info:
        load_settings(path, {})
    assert "targets.demo.max_retry_after_s" in str(info.value)
    assert "from 1 to 86400" in str(info.value)
