"""robots.txt obedience in the worker: may this job's URL be requested?

Per target, the rules come from this worker's cache, else from the ``jf-robots`` bucket
(shared by the fleet; its max age, ``fleet.robots_ttl_s``, is the cache's expiry), else
from a fetch of ``<scheme>://<host>/robots.txt``. That fetch is itself a request to the
target, so it first takes a permit from the ratelimit service (purpose ``robots``);
without one nothing is fetched and the job goes back for later. The fetched record is
written to the bucket, where the ratelimit service reads its Crawl-delay and
Request-rate as a rate cap.

An unreachable robots.txt (5xx, or no answer) is written with a per-key TTL of
``fleet.robots_error_hold_s``: for that long every worker holds the target (jobs go
back unrun as ``robots-unavailable``); then the key is gone and robots.txt is fetched
again. The worker writes the record through a ``PresenceWriter`` (it has no KV rights:
the leaser writes it, on ``jf.presence``) and reads the bucket directly. A worker keeps
what it fetched itself as long as the bucket does; what it read from the
bucket it asks about again after at most ``LOCAL_S`` (``ERROR_RECHECK_S`` for a hold),
since it cannot see how old the record is, so its copy is never much staler than the
bucket's.

One fetch at a time per target in a worker (jobs arriving meanwhile wait for it);
workers starting together may each fetch once, each with its own permit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp
import msgspec
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from jetfleet import subjects
from jetfleet.errors import JetfleetError
from jetfleet.leader_reads import replica_bucket
from jetfleet.lease_store import ttl_whole_seconds
from jetfleet.permit_client import PermitClient
from jetfleet.presence_writer import DirectPresenceWriter, PresenceWriter
from jetfleet.schemas.permit import PermitAllowed, PermitRequest, PermitWait
from jetfleet.schemas.targets import RobotsRecord
from jetfleet.settings import Settings
from jetfleet.worker.robots_fetch import fetch_robots
from jetfleet.worker.robots_rules import (
    ROBOTS_DISALLOWED,
    ROBOTS_UNAVAILABLE,
    RobotsRules,
    robots_url,
    unreachable,
)

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(RobotsRecord)

LOCAL_S = 30.0
"""The longest a worker uses robots rules read from the bucket before asking again."""
ERROR_RECHECK_S = 5.0
"""The longest a worker holds a target on a hold it read from the bucket before asking
again (the hold may have begun long before)."""


@dataclass(frozen=True)
class RobotsAllowed:
    """The URL may be requested (or the target does not obey robots.txt)."""


@dataclass(frozen=True)
class RobotsDisallowed:
    """robots.txt disallows the URL: the job ends ``robots-disallowed``, unsent."""

    detail: str
    reason: str = ROBOTS_DISALLOWED


@dataclass(frozen=True)
class RobotsNotYet:
    """No answer yet: hand the job back unrun for ``wait_s`` (``reason`` says why: the
    target's robots.txt is unreachable, or its fetch got no permit)."""

    reason: str
    wait_s: float
    detail: str = ""


RobotsAnswer = RobotsAllowed | RobotsDisallowed | RobotsNotYet


@dataclass(frozen=True)
class _Known:
    rules: RobotsRules
    until: float
    """Monotonic time after which the bucket is asked again."""


class RobotsBook:
    """The robots rules of the targets one worker serves."""

    def __init__(
        self,
        settings: Settings,
        js: JetStreamContext,
        permits: PermitClient,
        session: aiohttp.ClientSession,
        worker_id: str,
        identity: str = "",
        writer: PresenceWriter | None = None,
    ) -> None:
        self.settings = settings
        self.js = js
        self.writer: PresenceWriter = writer or DirectPresenceWriter(js)
        self._bucket = replica_bucket(js, subjects.BUCKET_ROBOTS)
        self.permits = permits
        self.session = session
        self.worker_id = worker_id
        self.identity = identity
        self._known: dict[str, _Known] = {}
        self._fetching: dict[str, asyncio.Lock] = {}
        # A fetch refused its permit, and until when: the jobs queued behind it go back
        # without asking again, one permit request per retry-after, not one per job.
        self._refused: dict[str, tuple[RobotsNotYet, float]] = {}

    def user_agent(self, target: str) -> str:
        """The User-Agent this fleet sends ``target`` (jobs and robots.txt alike)."""
        return self.settings.targets[target].user_agent or self.settings.fleet.user_agent

    async def check(self, target: str, url: str) -> RobotsAnswer:
        """Whether ``url`` of ``target`` may be requested now."""
        if not self.settings.targets[target].obey_robots:
            return RobotsAllowed()
        known = await self._rules(target)
        if isinstance(known, RobotsNotYet):
            return known
        rules = known.rules
        if rules.unreachable:
            return RobotsNotYet(
                ROBOTS_UNAVAILABLE,
                max(0.0, known.until - time.monotonic()),
                f"{robots_url(self.settings.targets[target].base_url)} answered "
                f"{rules.record.status or 'nothing'} {rules.record.error}".rstrip(),
            )
        if rules.allows(url, self.user_agent(target)):
            return RobotsAllowed()
        return RobotsDisallowed(
            f"{robots_url(self.settings.targets[target].base_url)} disallows {url} for "
            f"User-Agent {self.user_agent(target)!r}; nothing was sent"
        )

    async def _rules(self, target: str) -> _Known | RobotsNotYet:
        known = self._fresh(target)
        if known is not None:
            return known
        async with self._fetching.setdefault(target, asyncio.Lock()):
            known = self._fresh(target)  # fetched by the job this one waited for
            if known is not None:
                return known
            refused = self._still_refused(target)
            if refused is not None:
                return refused
            record = await self._read(target)
            fetched = record is None
            if record is None:
                got = await self._fetch(target)
                if isinstance(got, RobotsNotYet):
                    self._refused[target] = (got, time.monotonic() + got.wait_s)
                    return got
                record = got
                await self._write(record)
            known = _Known(RobotsRules.of(record), time.monotonic() + self._life_s(record, fetched))
            self._known[target] = known
            return known

    def _still_refused(self, target: str) -> RobotsNotYet | None:
        refused, until = self._refused.get(target, (None, 0.0))
        left_s = until - time.monotonic()
        if refused is None or left_s <= 0:
            return None
        return RobotsNotYet(refused.reason, left_s, refused.detail)

    def _fresh(self, target: str) -> _Known | None:
        known = self._known.get(target)
        return known if known is not None and time.monotonic() < known.until else None

    def _life_s(self, record: RobotsRecord, fetched: bool) -> float:
        """How long this worker keeps ``record``: what the bucket keeps it when this
        worker fetched it (so a record the bucket could not take is not fetched again
        sooner), else briefly, as the record's age in the bucket is not known here."""
        fleet = self.settings.fleet
        if unreachable(record.status):
            hold_s = fleet.robots_error_hold_s
            return hold_s if fetched else min(hold_s, ERROR_RECHECK_S)
        return fleet.robots_ttl_s if fetched else min(fleet.robots_ttl_s, LOCAL_S)

    async def _fetch(self, target: str) -> RobotsRecord | RobotsNotYet:
        """Fetch robots.txt, once its permit is taken; RobotsNotYet without one."""
        request = PermitRequest(
            target=target,
            worker=self.worker_id,
            identity=self.identity,
            egress=self.settings.worker.egress,
            purpose="robots",
        )
        reply = await self.permits.permit(request)
        if isinstance(reply, PermitWait):
            reason = "target-held" if reply.limit == "hold" else "rate-limited"
            return RobotsNotYet(reason, reply.retry_after_s, f"robots.txt: {reply.detail}")
        if not isinstance(reply, PermitAllowed):
            return RobotsNotYet(reply.reason, reply.retry_after_s, f"robots.txt: {reply.detail}")

        async def hop_permitted() -> bool:
            # A redirect hop is a request too: it takes a permit of its own, or the
            # fetch stops there (as unreachable: the target is held, nothing dropped).
            return isinstance(await self.permits.permit(request), PermitAllowed)

        record = await fetch_robots(
            self.session,
            target,
            self.settings.targets[target],
            self.user_agent(target),
            self.worker_id,
            hop_permitted,
        )
        # An unreachable robots.txt holds the target: worth an operator's eye.
        level = logging.WARNING if unreachable(record.status) else logging.INFO
        log.log(
            level,
            "robots.txt of %s: status %s, crawl delay %g s, request interval %g s %s",
            target,
            record.status,
            record.crawl_delay_s,
            record.request_interval_s,
            record.error,
        )
        return record

    async def _read(self, target: str) -> RobotsRecord | None:
        """The fleet's record of ``target``; None when there is none (or it cannot be
        read: then this worker fetches for itself)."""
        try:
            entry = await self._bucket.get(target)
        except KeyNotFoundError:
            return None
        except (NatsError, TimeoutError) as exc:
            log.warning("cannot read the robots.txt record of %s: %r", target, exc)
            return None
        if not entry.value:
            return None
        try:
            return _decoder.decode(entry.value)
        except msgspec.MsgspecError as exc:
            log.warning("ignoring a bad robots.txt record of %s: %s", target, exc)
            return None

    async def _write(self, record: RobotsRecord) -> None:
        """Share ``record`` with the fleet. A hold lives ``robots_error_hold_s`` (the key's
        own TTL); rules live the bucket's max age. Best effort: unshared, the rules still
        hold in this worker."""
        ttl = 0
        if unreachable(record.status):
            ttl = ttl_whole_seconds(self.settings.fleet.robots_error_hold_s)
        try:
            await self.writer.put(
                subjects.BUCKET_ROBOTS, record.target, _encoder.encode(record), ttl_s=ttl
            )
        except (NatsError, TimeoutError, JetfleetError) as exc:
            log.warning("could not share the robots.txt record of %s: %r", record.target, exc)
