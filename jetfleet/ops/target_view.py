"""What ``jetfleet target list|show`` prints: each target's limits in force and where
each came from (the config file, ``jetfleet target set``, or its robots.txt), its hold and
its jobs in flight.

The limits are worked out as the ratelimit service does (``Effective`` in
services/ratelimit/target_limits.py), from the same two buckets, so what is shown is what
permits obey.
"""

from __future__ import annotations

from typing import Literal, TypeVar

import msgspec
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.auth.credentials import without_secrets
from jetfleet.inflight_caps import CapsUnavailable, InFlightCaps
from jetfleet.rate_cells import RateCells, RateUnavailable
from jetfleet.schemas.targets import RobotsRecord, TargetLimits
from jetfleet.services.ratelimit.target_limits import Effective
from jetfleet.settings import Settings
from jetfleet.stream_reader import read_stream

_T = TypeVar("_T")
Source = Literal["config", "run time", "robots.txt"]
_limits_decoder = msgspec.json.Decoder(TargetLimits)
_robots_decoder = msgspec.json.Decoder(RobotsRecord)


class TargetView(msgspec.Struct, kw_only=True):
    """One target's limits in force (``--json`` of ``target list`` and ``target show``)."""

    target: str
    rate: float
    """Requests per second permits allow now (a Crawl-delay may have lowered it)."""
    rate_from: Source
    burst: int
    burst_from: Source
    daily: int
    """Requests per UTC day; 0: no budget."""
    daily_from: Source
    crawl_delay_s: float = 0.0
    """The Crawl-delay robots.txt asks (0: none, or the target does not obey robots.txt)."""
    held_s: float | None = None
    """Seconds left of the target's fleet-wide hold; None: not held (or Redis unknown)."""
    config: dict[str, float] = msgspec.field(default_factory=dict)
    """rate, burst and daily as the config file says."""
    run_time: TargetLimits | None = None
    """What ``jetfleet target set`` put in ``jf-targets``, who and why; None: nothing."""
    max_in_flight: int = 0
    in_flight: int | None = None
    """Jobs holding a place under ``max_in_flight`` now (``target show`` only)."""


class TargetListing(msgspec.Struct, kw_only=True):
    """Every declared target's view, and whether Redis answered for the holds."""

    targets: list[TargetView]
    redis: str = "ok"
    """``ok``, or why holds (and in-flight counts) could not be read."""


async def target_listing(
    js: JetStreamContext, settings: Settings, only: str | None = None
) -> TargetListing:
    """The view of every declared target (or of ``only``, with its in-flight count).

    Raises:
        ConfigError: ``only`` is not declared.
    """
    names = [only] if only is not None else list(settings.targets)
    if only is not None:
        settings.target(only)
    overrides = await _entries(js, subjects.BUCKET_TARGETS, _limits_decoder)
    robots = await _entries(js, subjects.BUCKET_ROBOTS, _robots_decoder)
    views = [_view(settings, name, overrides.get(name), robots.get(name)) for name in names]
    redis = await _add_redis_state(settings, views, counts=only is not None)
    return TargetListing(targets=views, redis=redis)


def _view(
    settings: Settings, name: str, run_time: TargetLimits | None, robots: RobotsRecord | None
) -> TargetView:
    declared = settings.targets[name]
    # As the ratelimit service reads it: the stricter of Crawl-delay and Request-rate.
    crawl = (
        max(robots.crawl_delay_s, robots.request_interval_s)
        if robots is not None and declared.obey_robots
        else 0.0
    )

    def pick(value: float | int | None, config: float | int) -> tuple[float, Source]:
        return (value, "run time") if value is not None else (config, "config")

    rate, rate_from = pick(run_time.rate if run_time else None, declared.rate)
    burst, burst_from = pick(run_time.burst if run_time else None, declared.burst)
    daily, daily_from = pick(run_time.daily if run_time else None, declared.daily)
    limits = Effective(rate=rate, burst=int(burst), daily=int(daily), crawl_delay_s=crawl)
    lowered = limits.target_rate < rate
    return TargetView(
        target=name,
        rate=limits.target_rate,
        rate_from="robots.txt" if lowered else rate_from,
        burst=limits.target_burst,
        burst_from="robots.txt" if limits.target_burst != burst else burst_from,
        daily=int(daily),
        daily_from=daily_from,
        crawl_delay_s=crawl,
        config={"rate": declared.rate, "burst": declared.burst, "daily": declared.daily},
        run_time=run_time,
        max_in_flight=declared.max_in_flight,
    )


async def _add_redis_state(settings: Settings, views: list[TargetView], counts: bool) -> str:
    cells = RateCells.connect(settings.redis.url)
    caps = InFlightCaps.connect(settings.redis.url) if counts else None
    try:
        holds = await cells.holds()
        in_flight = await caps.counts([v.target for v in views]) if caps else {}
    except (RateUnavailable, CapsUnavailable) as exc:
        return (
            f"redis at {without_secrets(settings.redis.url)} did not answer ({exc}): holds unknown"
        )
    finally:
        await cells.close()
        if caps is not None:
            await caps.close()
    for view in views:
        left = holds.get(view.target)
        view.held_s = None if left is None else round(left, 3)
        if counts:
            view.in_flight = in_flight.get(view.target, 0)
    return "ok"


async def _entries(
    js: JetStreamContext, bucket: str, decoder: msgspec.json.Decoder[_T]
) -> dict[str, _T]:
    """Every live entry of ``bucket``, read from its stream (``kv.keys()`` can miss keys
    under concurrent writes, nats.py issue 842)."""
    found: dict[str, _T] = {}
    prefix = f"$KV.{bucket}."
    async for msg in read_stream(js, f"KV_{bucket}", f"$KV.{bucket}.>"):
        key = msg.subject[len(prefix) :]
        if not msg.data or (msg.headers or {}).get("KV-Operation"):
            found.pop(key, None)  # a delete or purge marker
            continue
        try:
            found[key] = decoder.decode(msg.data)
        except msgspec.MsgspecError:
            continue  # the ratelimit service logs and ignores it too
    return found
