"""The simulator's scripted behaviours the showcase uses: a 429 storm from the first
request, pages served counted per path, and the requests pending now. A real server on
127.0.0.1, real HTTP clients."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp
import pytest

from jetfleet.simulator import SimulatorConfig, TargetSimulator
from jetfleet.simulator.routes import WORKER_HEADER


async def _until(condition: Callable[[], bool], within_s: float = 5.0) -> None:
    # Polls a real condition; the sleep only yields to the server between checks.
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_a_storm_answers_429_with_retry_after_from_the_first_request_then_ends() -> None:
    config = SimulatorConfig(storm_s=0.5, storm_retry_after_s=3)
    async with TargetSimulator(config) as sim, aiohttp.ClientSession() as client:
        async with client.get(sim.base_url + "/robots.txt") as robots:
            assert robots.status == 200  # robots.txt stays out of the storm
        statuses: list[int] = []
        async with client.get(sim.base_url + "/page/1") as first:
            assert (first.status, first.headers["Retry-After"]) == (429, "3")
        # The storm lasts storm_s from that first request: poll until it has passed.
        deadline = time.monotonic() + 10
        while True:
            async with client.get(sim.base_url + "/page/2") as again:
                statuses.append(again.status)
            if again.status == 200 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert statuses[-1] == 200, statuses
        counts = sim.counts()["by_path_kind"]
        assert counts["ratelimited"] == len(statuses)  # the first and the stormed retries
        assert sim.served_by_path() == {"/robots.txt": 1, "/page/2": 1}


def test_storm_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="storm_s"):
        SimulatorConfig(storm_s=-1)
    with pytest.raises(ValueError, match="storm_retry_after_s"):
        SimulatorConfig(storm_retry_after_s=-1)


async def test_a_request_dropped_before_its_answer_is_pending_then_never_served() -> None:
    async with (
        TargetSimulator(SimulatorConfig(latency_s=5.0)) as sim,
        aiohttp.ClientSession(headers={WORKER_HEADER: "w-victim"}) as client,
    ):
        request = asyncio.create_task(client.get(sim.base_url + "/page/3"))
        await _until(lambda: len(sim.pending()) == 1)
        [pending] = sim.pending()
        assert (pending.client, pending.path) == ("w-victim", "/page/3")
        # The client goes away mid-request, as a killed worker's connection does.
        request.cancel()
        await _until(lambda: not sim.pending())
        assert sim.served_by_path() == {}
        assert sim.counts()["total"] == 1


async def test_served_counts_only_2xx_answers_and_reset_clears_them() -> None:
    async with TargetSimulator(SimulatorConfig()) as sim, aiohttp.ClientSession() as client:
        for path in (
            "/page/1",
            "/page/1",
            "/missing/1",
            "/challenge/1?times=1",
            "/challenge/1?times=1",
        ):
            async with client.get(sim.base_url + path) as answer:
                await answer.read()
        assert sim.served_by_path() == {"/page/1": 2, "/challenge/1": 1}
        sim.reset()
        assert sim.served_by_path() == {}
