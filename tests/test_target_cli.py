"""Issue 9: ``jetfleet target list|show|set|unset``, per-target limits at run time.

A change is a ``TargetLimits`` record in ``jf-targets``; every ratelimit replica follows
the bucket with a KV watch. The rate test counts at the target simulator: a backlog at
2/s, raised to 10/s with ``jetfleet target set`` while two ratelimit replicas, two
workers and one leaser run (none restarted), then lowered again; each change shows in the
requests the target receives within about a second.

Real servers: a fresh nats-server, the session's redis-server, the target simulator.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from jetfleet.schemas.targets import RobotsRecord, TargetLimits
from jetfleet.services.ratelimit import RateLimiter
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from redis import asyncio as aioredis

from jetfleet import subjects
from jetfleet.cli.main import main
from jetfleet.connection import connect_nats
from jetfleet.dev.settings_file import settings_toml
from jetfleet.errors import JetfleetError
from jetfleet.ops.run_time_limits import LimitChange, parse_rate, set_limits
from jetfleet.rate_cells import KEY_HOLDS, hold_key
from jetfleet.settings import Settings
from jetfleet.simulator import SimulatorConfig, TargetSimulator
from tests.conftest import bucket_keys, wait_for
from tests.queueing.helpers import queue_settings, submit_paths, target
from tests.stack import InProcessStack
from tests.user_servers import flush_test_db


@pytest.fixture
async def redis_db(redis_client: aioredis.Redis) -> AsyncIterator[aioredis.Redis]:
    """The tests' Redis, emptied before and after: a hold left behind would hold the
    next test's target (the session shares one redis-server)."""
    yield redis_client
    await flush_test_db(redis_client)


def _config(settings: Settings, tmp_path: Path) -> str:
    path = tmp_path / "jetfleet.toml"
    path.write_text(settings_toml(settings))
    return str(path)


async def _cli(config: str, *argv: str) -> int:
    """``jetfleet --config CONFIG ARGV``, in a thread (the CLI runs its own event loop)."""
    return await asyncio.to_thread(main, ["--config", config, *argv])


async def _json_out(capsys: pytest.CaptureFixture[str], config: str, *argv: str) -> object:
    capsys.readouterr()
    assert await _cli(config, *argv, "--json") == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("text", "per_second"),
    [("5/s", 5.0), ("300/m", 5.0), ("18000/h", 5.0), ("0.5", 0.5), (" 2 / s ", 2.0)],
)
def test_a_rate_is_read_per_second_minute_or_hour(text: str, per_second: float) -> None:
    assert parse_rate(text) == pytest.approx(per_second)


@pytest.mark.parametrize("text", ["0", "0/s", "-1", "5/d", "fast", "inf", "nan", "1e400/s", ""])
def test_a_rate_that_is_not_a_finite_positive_rate_is_refused_with_the_forms(text: str) -> None:
    with pytest.raises(JetfleetError, match=r"5/s, 300/m, 18000/h"):
        parse_rate(text)


async def test_set_merges_show_says_where_each_value_is_from_and_unset_restores_the_config(
    settings: Settings,
    nc: NatsClient,
    redis_db: aioredis.Redis,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A target that obeys robots.txt (the tests' shared one does not: they count requests).
    obeying = msgspec.structs.replace(settings.targets["demo"], obey_robots=True)
    settings = msgspec.structs.replace(settings, targets={"demo": obeying})
    config = _config(settings, tmp_path)
    declared = settings.targets["demo"]
    args = ("target", "set", "demo", "--rate", "300/m", "--burst", "2", "--reason", "owner asked")
    assert await _cli(config, *args, "--set-by", "ana@ops") == 0
    assert (
        await _cli(config, "target", "set", "demo", "--daily", "50000", "--set-by", "bo@ops") == 0
    )
    kv = await nc.jetstream().key_value(subjects.BUCKET_TARGETS)
    stored = msgspec.json.decode((await kv.get("demo")).value or b"", type=TargetLimits)
    # The second change kept the first one's rate and burst; who and why are the latest.
    assert stored == TargetLimits(rate=5.0, burst=2, daily=50000, set_by="bo@ops")

    # A Crawl-delay of 2 s in robots.txt lowers the rate below the run-time 5/s.
    robots = await nc.jetstream().key_value(subjects.BUCKET_ROBOTS)
    record = RobotsRecord(target="demo", status=200, crawl_delay_s=2.0)
    await robots.put("demo", msgspec.json.encode(record))
    ends = (await _redis_now_us(redis_db)) + 30_000_000
    await redis_db.set(hold_key("demo"), str(ends))  # as the hold script leaves it
    await redis_db.zadd(KEY_HOLDS, {"demo": ends})
    shown = await _json_out(capsys, config, "target", "show", "demo")
    assert isinstance(shown, dict)
    assert (shown["rate"], shown["rate_from"]) == (0.5, "robots.txt")
    assert (shown["burst"], shown["burst_from"]) == (1, "robots.txt")
    assert (shown["daily"], shown["daily_from"]) == (50000, "run time")
    assert shown["crawl_delay_s"] == 2.0
    assert 28 < shown["held_s"] <= 30
    assert shown["in_flight"] == 0
    assert shown["config"] == {"rate": declared.rate, "burst": declared.burst, "daily": 0}
    assert shown["run_time"]["set_by"] == "bo@ops"
    capsys.readouterr()
    assert await _cli(config, "target", "show", "demo") == 0
    text = capsys.readouterr().out
    assert "from robots.txt" in text and "from run time" in text and "s left" in text, text

    await robots.delete("demo")
    assert await _cli(config, "target", "unset", "demo") == 0
    listed = await _json_out(capsys, config, "target", "list")
    assert isinstance(listed, dict)
    [view] = listed["targets"]
    assert (view["rate"], view["rate_from"]) == (declared.rate, "config")
    assert (view["burst"], view["burst_from"]) == (declared.burst, "config")
    assert view["run_time"] is None and listed["redis"] == "ok"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("--rate", "0"), "from one a day"),
        (("--rate", "ten"), "is not a rate"),
        (("--burst", "0"), "--burst 0 is below 1"),
        (("--burst", "2.5"), "--burst '2.5' is not a whole number"),
        (("--daily", "-1"), "--daily -1 is below 0"),
        ((), "nothing to set"),
        (("--rate", "1", "--clear"), "--clear alone"),
        (("--rate", "1", "--reason", "x" * 300), "--reason must be at most 256"),
    ],
)
async def test_set_refuses_a_bad_value_saying_what_to_fix_and_writes_nothing(
    settings: Settings,
    nc: NatsClient,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: tuple[str, ...],
    says: str,
) -> None:
    config = _config(settings, tmp_path)
    assert await _cli(config, "target", "set", "demo", *argv) == 2
    assert says in capsys.readouterr().err
    assert await bucket_keys(nc, subjects.BUCKET_TARGETS) == []


async def test_set_refuses_a_target_the_config_does_not_declare(
    settings: Settings, nc: NatsClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(settings, tmp_path)
    assert await _cli(config, "target", "set", "shop", "--rate", "5/s") == 2
    assert "declare it as [targets.shop]" in capsys.readouterr().err


async def test_a_rate_change_reaches_the_target_within_a_second_through_every_replica(
    nats_url: str, redis_url: str, redis_db: aioredis.Redis, tmp_path: Path
) -> None:
    async with TargetSimulator(SimulatorConfig()) as sim:
        targets = {"paced": target(sim.base_url, rate=2.0, burst=1, max_in_flight=500)}
        settings = queue_settings(nats_url, redis_url, targets, concurrency=4)
        stack = InProcessStack(settings)
        await stack.start(workers=2)
        second = await connect_nats(settings.nats, "ratelimit-2")
        replica = RateLimiter(settings, second)
        await replica.start()
        assert stack.ratelimit is not None
        replicas = [stack.ratelimit, replica]
        try:
            js = stack.connections[0].jetstream()
            await submit_paths(js, settings, "paced", [f"/page/{n}" for n in range(500)], "b")
            paced = await _windows(sim, time.time() + 0.5, seconds=2)
            assert all(1 <= n <= 3 for n in paced), (paced, sim.counts()["windows"])

            raised_at = await _change(js, settings, replicas, rate=10.0, burst=2)
            # From the second that starts at least 1 s after the change: twice what 2/s
            # allows (at most 3 in a second), never above 10 + the burst, and 80 % of
            # the new cap in all (9 to 10 a second measured here; not 10 in each, as a
            # permit asked late is not made up for with a burst of 2).
            windows = await _windows(sim, raised_at + 1, seconds=3)
            assert all(6 <= n <= 12 for n in windows), (windows, sim.counts()["windows"])
            assert sum(windows) >= 24, (windows, sim.counts()["windows"])

            lowered_at = await _change(js, settings, replicas, rate=2.0, burst=None)
            windows = await _windows(sim, lowered_at + 1, seconds=3)
            # 2/s and the burst of 2 set with 10/s (a field not given keeps its value).
            assert all(1 <= n <= 4 for n in windows), (windows, sim.counts()["windows"])
            assert sim.max_in_any_window(1.0) <= 12, sim.counts()["windows"]
            # The same leaser and workers throughout: nothing was restarted.
            assert [w.worker_id for w in stack.workers] == ["w-0", "w-1"]
        finally:
            await replica.drain(5.0)
            await second.close()
            await stack.stop()


async def _change(
    js: JetStreamContext,
    settings: Settings,
    replicas: list[RateLimiter],
    rate: float,
    burst: int | None,
) -> float:
    """Set the rate as ``jetfleet target set`` does; return the wall time it was written,
    once every replica applies it (within a second, or the test fails)."""
    await set_limits(
        js, settings, "paced", LimitChange(rate=rate, burst=burst, set_by="tests@here")
    )
    written = time.time()

    async def applied() -> bool:
        return all(r.limits.effective("paced").rate == rate for r in replicas)

    await wait_for(applied, 1.0, f"both ratelimit replicas to apply {rate}/s")
    return written


async def _windows(sim: TargetSimulator, after: float, seconds: int) -> list[int]:
    """The requests the simulator counted in each of the ``seconds`` whole wall-clock
    seconds starting at or after ``after``, once they are over."""
    first = int(after) + (0 if after == int(after) else 1)
    await _until_second(first + seconds)
    counted = sim.counts()["windows"]
    return [int(counted.get(str(second), 0)) for second in range(first, first + seconds)]


async def _until_second(wall: float) -> None:
    async def reached() -> bool:
        return time.time() >= wall

    await wait_for(reached, wall - time.time() + 5, f"wall clock {wall:.0f}")


async def _redis_now_us(client: aioredis.Redis) -> int:
    seconds, micros = await client.time()
    return int(seconds) * 1_000_000 + int(micros)


async def test_set_refuses_to_merge_with_an_entry_that_is_not_a_record_and_unset_removes_it(
    settings: Settings, nc: NatsClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kv = await nc.jetstream().key_value(subjects.BUCKET_TARGETS)
    await kv.put("demo", b'{"rate": "fast"}')
    assert await bucket_keys(nc, subjects.BUCKET_TARGETS) == ["demo"]  # the check sees keys
    config = _config(settings, tmp_path)
    assert await _cli(config, "target", "set", "demo", "--burst", "3") == 2
    assert "jetfleet target unset demo" in capsys.readouterr().err
    assert await _cli(config, "target", "unset", "demo") == 0
    assert await _cli(config, "target", "set", "demo", "--burst", "3") == 0
    stored = msgspec.json.decode((await kv.get("demo")).value or b"", type=TargetLimits)
    assert stored.burst == 3 and stored.rate is None


async def test_two_changes_at_once_to_different_fields_both_stay(
    settings: Settings, nc: NatsClient
) -> None:
    js = nc.jetstream()
    for n in range(1, 6):
        # Both read the entry before either writes: a plain put would drop one of them.
        await asyncio.gather(
            set_limits(js, settings, "demo", LimitChange(rate=float(n), set_by="a")),
            set_limits(js, settings, "demo", LimitChange(daily=n * 100, set_by="b")),
        )
        kv = await js.key_value(subjects.BUCKET_TARGETS)
        stored = msgspec.json.decode((await kv.get("demo")).value or b"", type=TargetLimits)
        assert (stored.rate, stored.daily) == (float(n), n * 100), stored


@pytest.mark.parametrize(
    "change",
    [LimitChange(rate=-1.0), LimitChange(rate=float("inf")), LimitChange(burst=0)],
)
async def test_set_limits_refuses_what_the_ratelimit_service_could_not_read(
    settings: Settings, nc: NatsClient, change: LimitChange
) -> None:
    with pytest.raises(JetfleetError, match="must be"):
        await set_limits(nc.jetstream(), settings, "demo", change)
