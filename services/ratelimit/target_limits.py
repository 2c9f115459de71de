"""Each target's limits as they stand now: the config file, what ``jetfleet target set``
put in ``jf-targets``, and the Crawl-delay its robots.txt asks for (``jf-robots``).

Both buckets are followed with a KV watch, so a change reaches every replica within
milliseconds, and a permit costs no KV read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import msgspec
from jetfleet.schemas.permit import PermitRequest
from jetfleet.schemas.targets import RobotsRecord, TargetLimits
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.rate_cells import Cell, fleet_cell_key, target_cell_key
from jetfleet.settings import Settings, TargetSettings

log = logging.getLogger(__name__)
_limits_decoder = msgspec.json.Decoder(TargetLimits)
_robots_decoder = msgspec.json.Decoder(RobotsRecord)
LOAD_TIMEOUT_S = 10.0
UNLABELLED = "_unlabelled"
"""The egress (or identity) cell of requests that name none."""


@dataclass(frozen=True)
class Effective:
    """One target's limits in force."""

    rate: float
    burst: int
    daily: int
    crawl_delay_s: float
    """The spacing robots.txt asks for: the stricter of its Crawl-delay and Request-rate
    for the fleet's User-Agent; 0 when it asks none (or the target does not obey
    robots.txt)."""

    @property
    def target_rate(self) -> float:
        """The target's rate, lowered to one request per Crawl-delay."""
        if self.crawl_delay_s > 0:
            return min(self.rate, 1.0 / self.crawl_delay_s)
        return self.rate

    @property
    def target_burst(self) -> int:
        # A Crawl-delay is a spacing between requests: no burst on top of it, whatever
        # the configured rate.
        return 1 if self.crawl_delay_s > 0 else self.burst


class TargetLimitBook:
    """Follows ``jf-targets`` and ``jf-robots``; answers the cells of a permit."""

    def __init__(self, settings: Settings, js: JetStreamContext) -> None:
        self.settings = settings
        self.js = js
        self._overrides: dict[str, TargetLimits] = {}
        self._crawl_delays: dict[str, float] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Load what both buckets hold and follow their changes."""
        loaded = []
        for bucket, apply in (
            (subjects.BUCKET_TARGETS, self._apply_limits),
            (subjects.BUCKET_ROBOTS, self._apply_robots),
        ):
            kv = await self.js.key_value(bucket)
            watcher = await kv.watchall()
            done = asyncio.get_running_loop().create_future()
            self._tasks.append(asyncio.create_task(self._follow(watcher, apply, done)))
            loaded.append(done)
        await asyncio.wait_for(asyncio.gather(*loaded), LOAD_TIMEOUT_S)

    async def stop(self) -> None:
        """Stop following."""
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()

    def effective(self, target: str) -> Effective:
        """``target``'s limits in force (the target must be declared)."""
        base: TargetSettings = self.settings.targets[target]
        override = self._overrides.get(target)
        crawl = self._crawl_delays.get(target, 0.0) if base.obey_robots else 0.0
        return Effective(
            rate=override.rate if override and override.rate is not None else base.rate,
            burst=override.burst if override and override.burst is not None else base.burst,
            daily=override.daily if override and override.daily is not None else base.daily,
            crawl_delay_s=crawl,
        )

    def cells(self, request: PermitRequest) -> tuple[list[Cell], int]:
        """The cells a request to ``request.target`` must pass, and its daily budget."""
        target = request.target
        limits = self.effective(target)
        declared = self.settings.targets[target]
        cells = [self.target_cell(target)]
        fleet = self.settings.fleet
        if fleet.rate > 0:
            cells.append(Cell("fleet", fleet_cell_key(), fleet.rate, fleet.burst))
        # Workers that name no egress (or identity) share one cell: a limit that applies
        # must not be skipped for want of a label.
        if declared.egress_rate > 0:
            key = target_cell_key(target, "egress", request.egress or UNLABELLED)
            cells.append(Cell("egress", key, declared.egress_rate, declared.egress_burst))
        if declared.identity_rate > 0:
            key = target_cell_key(target, "identity", request.identity or UNLABELLED)
            cells.append(Cell("identity", key, declared.identity_rate, declared.identity_burst))
        return cells, limits.daily

    def target_cell(self, target: str) -> Cell:
        """The target's own cell (a hold pushes it so the target resumes at its rate)."""
        limits = self.effective(target)
        slack_us = round(self.settings.targets[target].send_jitter_s * 1_000_000)
        return Cell(
            "target",
            target_cell_key(target, "target"),
            limits.target_rate,
            limits.target_burst,
            slack_us,
        )

    async def _follow(self, watcher: Any, apply: Any, loaded: asyncio.Future[None]) -> None:
        async for entry in watcher:
            if entry is None:
                if not loaded.done():
                    loaded.set_result(None)
                continue
            gone = entry.operation in ("DEL", "PURGE") or not entry.value
            if entry.key not in self.settings.targets:
                # A target since removed from the config, or a hand-made key: nothing
                # asks for its permits, and it must not stop the watch.
                log.warning("ignoring %s entry %s: no such target", entry.bucket, entry.key)
                continue
            try:
                apply(entry.key, None if gone else entry.value)
            except Exception as exc:  # one bad entry must not end the watch
                log.error("ignoring bad %s entry %s: %s", entry.bucket, entry.key, exc)

    def _apply_limits(self, target: str, value: bytes | None) -> None:
        if value is None:
            self._overrides.pop(target, None)
            return
        self._overrides[target] = _limits_decoder.decode(value)
        log.info("target %s limits now %s", target, self.effective(target))

    def _apply_robots(self, target: str, value: bytes | None) -> None:
        if value is None:
            self._crawl_delays.pop(target, None)
            return
        record = _robots_decoder.decode(value)
        if record.status in (0, 429) or record.status >= 500:
            # robots.txt could not be read this time (the workers hold the target): the
            # delay it last asked for still stands for workers on cached rules.
            return
        # Crawl-delay and Request-rate both space requests: the stricter one holds.
        delay = max(record.crawl_delay_s, record.request_interval_s)
        if delay > 0:
            self._crawl_delays[target] = delay
        else:
            self._crawl_delays.pop(target, None)
