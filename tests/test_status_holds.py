"""Issue 9: fleet-wide holds and the rate limiter's health in ``jetfleet status``.

A hold lives in Redis (the end time by Redis's clock), so it shows in status from any
process, survives draining and restarting the ratelimit service and the leaser, and
still refuses grants after it. Status tells ``ok`` from ``failing-closed`` by asking the
limiter's Redis itself, and stays bounded with many targets held.

Real servers: a fresh nats-server, the session's redis-server, the target simulator,
scheduler + leaser + ratelimit + sink + one worker and a gateway in this process.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import msgspec
import pytest
from jetfleet.schemas.permit import PermitRequest, PermitWait
from jetfleet.services.gateway import Gateway
from nats.aio.client import Client as NatsClient
from redis import asyncio as aioredis

from jetfleet.cli.main import main
from jetfleet.connection import connect_nats
from jetfleet.dev.settings_file import settings_toml
from jetfleet.lease_client import LeaseClient
from jetfleet.ops.limiter_state import MAX_HOLDS_SHOWN
from jetfleet.ops.status import FleetStatus, fleet_status
from jetfleet.permit_client import PermitClient
from jetfleet.rate_cells import KEY_HOLDS, hold_key
from jetfleet.settings import GatewaySettings, RedisSettings, Settings
from jetfleet.simulator import TargetSimulator
from tests.conftest import wait_for
from tests.leasing import ask, order_for, refused
from tests.prom_text import value
from tests.queueing.helpers import submit_paths
from tests.stack import InProcessStack
from tests.user_servers import flush_test_db

pytestmark = pytest.mark.timeout(90)

RETRY_AFTER_S = 30


@pytest.fixture
async def redis_db(redis_client: aioredis.Redis) -> AsyncIterator[aioredis.Redis]:
    """The tests' Redis, emptied before and after: a hold left behind would hold the
    next test's target (the session shares one redis-server)."""
    yield redis_client
    await flush_test_db(redis_client)


async def _status_cli(
    settings: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str
) -> str:
    path = tmp_path / "jetfleet.toml"
    path.write_text(settings_toml(settings))
    capsys.readouterr()
    code = await asyncio.to_thread(main, ["--config", str(path), "status", *argv])
    assert code == 0
    return capsys.readouterr().out


async def test_a_hold_shows_in_status_and_outlives_a_restart_of_the_limiter_and_leaser(
    settings: Settings,
    nc: NatsClient,
    redis_db: aioredis.Redis,
    simulator: TargetSimulator,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    stack = InProcessStack(settings)
    await stack.start(workers=1)
    gateway_nc = await connect_nats(settings.nats, "gateway")
    gateway = Gateway(
        msgspec.structs.replace(settings, gateway=GatewaySettings(port=0)), gateway_nc
    )
    await gateway.start()
    try:
        js = nc.jetstream()
        path = f"/ratelimited/0?retry_after={RETRY_AFTER_S}"
        await submit_paths(js, settings, "demo", [path], "held")

        async def held() -> bool:
            return (await fleet_status(js, settings)).held == 1

        # The worker got the 429 and asked the ratelimit service to hold demo for all.
        await wait_for(held, 20, "the 429's Retry-After to hold demo fleet-wide")
        status = await fleet_status(js, settings)
        assert status.rate_limiter == "ok" and status.rate_limiter_detail == ""
        [hold] = status.holds
        assert hold.target == "demo" and RETRY_AFTER_S - 5 < hold.seconds_left <= RETRY_AFTER_S

        # Services drained and started again: the hold is in Redis, not in them.
        assert stack.ratelimit is not None and stack.leaser is not None
        await stack.ratelimit.drain(5.0)
        await stack.leaser.drain(5.0)
        await stack.start_ratelimit()
        await stack.start_leaser()

        after = await fleet_status(js, settings)
        assert [h.target for h in after.holds] == ["demo"] and after.held == 1
        assert after.holds[0].seconds_left < hold.seconds_left
        # What a worker asks just before a request, and what a leaser asked by a worker
        # from before permits moved to the worker answers: both say held.
        wait = await PermitClient(nc).permit(PermitRequest(target="demo", worker="w-t"))
        assert isinstance(wait, PermitWait) and wait.limit == "hold", wait
        assert 20 < wait.retry_after_s <= RETRY_AFTER_S
        older = ask(order_for(settings, "/page/1"), sends_request=True)
        refusal = await refused(LeaseClient(nc), older)
        assert refusal.reason == "target-held", refusal
        assert 20 < refusal.retry_after_s <= RETRY_AFTER_S
        assert simulator.counts()["total"] == 1  # nothing sent to demo while it is held

        text = await _status_cli(settings, tmp_path, capsys)
        assert "rate limiter: ok" in text
        assert "held targets: 1" in text and "s left" in text.split("held targets: 1")[1]
        as_json = json.loads(await _status_cli(settings, tmp_path, capsys, "--json"))
        assert as_json["held"] == 1 and as_json["holds"][0]["target"] == "demo"

        async with aiohttp.ClientSession() as http:
            async with http.get(f"{gateway.url}/v1/status") as response:
                served = await response.json()
            async with http.get(f"{gateway.url}/metrics") as response:
                metrics = await response.text()
        assert served["rate_limiter"] == "ok" and served["held"] == 1, served
        assert served["holds"][0]["target"] == "demo"
        assert value(metrics, "jetfleet_ratelimit_ok") == 1
        assert value(metrics, "jetfleet_targets_held") == 1
        left = value(metrics, "jetfleet_target_hold_seconds", target="demo")
        assert left is not None and 0 < left <= RETRY_AFTER_S
    finally:
        await gateway.drain(5.0)
        await gateway_nc.close()
        await stack.stop()


async def test_status_says_the_rate_limiter_fails_closed_while_its_redis_does_not_answer(
    settings: Settings, nc: NatsClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Port 1 on loopback: nothing listens, so every connection is refused at once.
    cut_off = msgspec.structs.replace(settings, redis=RedisSettings(url="redis://127.0.0.1:1/0"))
    status = await fleet_status(nc.jetstream(), cut_off)
    assert status.rate_limiter == "failing-closed"
    assert "redis://127.0.0.1:1/0 does not answer" in status.rate_limiter_detail
    assert status.holds == [] and status.conserved  # the counts are still read
    text = await _status_cli(cut_off, tmp_path, capsys)
    assert "rate limiter: failing-closed: redis at redis://127.0.0.1:1/0" in text


async def test_status_lists_the_longest_holds_and_counts_the_rest_with_many_targets_held(
    settings: Settings,
    nc: NatsClient,
    redis_db: aioredis.Redis,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    seconds, micros = await redis_db.time()
    now_us = int(seconds) * 1_000_000 + int(micros)
    held = 3000
    async with redis_db.pipeline(transaction=False) as pipe:
        # As the hold script leaves them: the hold's key and its place in the index.
        for n in range(held):
            ends = now_us + (60 + n) * 1_000_000
            pipe.set(hold_key(f"t{n:04}"), str(ends), px=300_000)
            pipe.zadd(KEY_HOLDS, {f"t{n:04}": ends})
        # An ended hold still in the index (its key not expired yet) is not a hold.
        pipe.set(hold_key("ended"), str(now_us - 1_000_000), px=300_000)
        pipe.zadd(KEY_HOLDS, {"ended": now_us - 1_000_000})
        await pipe.execute()

    status: FleetStatus = await fleet_status(nc.jetstream(), settings)
    assert status.held == held
    assert len(status.holds) == MAX_HOLDS_SHOWN
    assert [h.target for h in status.holds[:2]] == ["t2999", "t2998"]  # longest first
    assert len(msgspec.json.encode(status)) < 10_000
    text = await _status_cli(settings, tmp_path, capsys)
    assert f"held targets: {held}" in text
    assert f"... and {held - MAX_HOLDS_SHOWN} more" in text
