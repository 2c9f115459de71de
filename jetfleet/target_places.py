"""The in-flight places of every target, as the services keep them.

A target's ``max_in_flight`` counts its jobs in flight across all its priority tiers
(and, for a partitioned target, across the members of its partition): the server's
``max_ack_pending`` bounds each consumer, but a target's three tiers together could hold
three times the cap. So the leaser takes a place in Redis for every grant
(``InFlightCaps``), keeps it with each renewal and frees it on release or revoke; the
sink frees it when it settles the job. Keeping and freeing are best effort, since a place
also expires with its lease; only taking one can refuse (docs/rate-limits.md).
A job leased to a worker that declares a subnet also holds its target for that subnet
(``SubnetHolds``, in the same Redis), kept and freed with its place.

While Redis is unreachable the holds are not renewed, so they may run out (or go with
Redis's state) while their jobs still run. So for one lease TTL after a subnet call of
a (target, subnet) last failed here, a grant holds that pair only for a worker holding
it already (``own_only``): the running jobs' renewals, one a third of a TTL, restore
their holds first. Only this replica's failures count: a pair whose holder renewed
through another replica is held back only there (docs/leases.md, "One worker per
subnet").
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from jetfleet import inflight_caps, subnet_holds
from jetfleet.inflight_caps import CapsUnavailable, InFlightCaps
from jetfleet.settings import Settings
from jetfleet.subnet_holds import SubnetHolds, Took

log = logging.getLogger(__name__)

RECOVERING_MAX = 4096
"""Pairs remembered as recovering before the ended ones are forgotten."""

# KEYS: the target's places, its subnet holds; ARGV: the job id. A settled job's place and
# every subnet hold of it in one round trip (subnet_holds' drop of the job after the ZREM).
_FREE_SETTLED = "redis.call('ZREM', KEYS[1], ARGV[1])\n" + subnet_holds.DROP_JOB_LUA.replace(
    "KEYS[1]", "KEYS[2]"
)

Taken = Literal["full", "kept", "taken"]
"""What taking a place did: refused (the target is full), found the job's place already
held (a grant made again), or took a new one."""


class TargetPlaces:
    """Take, keep, free and count the places of the fleet's targets."""

    def __init__(self, settings: Settings) -> None:
        self.ttl_s = settings.fleet.lease_ttl_s
        self.targets = list(settings.targets)
        """Every declared target, in declaration order."""
        self.caps = InFlightCaps.connect(settings.redis.url, settings.fleet.service_concurrency)
        self.subnets = SubnetHolds(self.caps.client)
        # A cluster's script takes keys of one slot only, and the two keys are not
        # tagged alike: two calls there.
        self._free_settled: Any = (
            None
            if isinstance(self.caps.client, RedisCluster)
            else self.caps.client.register_script(_FREE_SETTLED)
        )
        # (target, subnet) -> monotonic end of its recovery: see the module's docstring.
        self._recovering: dict[tuple[str, str], float] = {}

    def recovering_s(self, target: str, subnet: str) -> float:
        """Seconds a grant still holds ``target`` for ``subnet`` only for a worker
        holding it already (0: for any worker of the subnet)."""
        return max(0.0, self._recovering.get((target, subnet), 0.0) - time.monotonic())

    def _failed(self, target: str, subnet: str) -> None:
        now = time.monotonic()
        if len(self._recovering) >= RECOVERING_MAX:
            self._recovering = {k: t for k, t in self._recovering.items() if t > now}
        self._recovering[(target, subnet)] = now + self.ttl_s

    async def hold_subnet(
        self, target: str, job_id: str, worker: str, subnet: str, restore: bool = False
    ) -> Took | float:
        """Hold ``target`` for ``subnet`` with this job of ``worker``: ``taken`` or
        ``kept``, else the seconds until another worker's hold runs out unless renewed
        (``subnet_holds.OWN_ONLY`` while recovering from an outage, for a worker holding
        nothing of it). ``restore``: a running job's renewal putting its lost hold back,
        never held back by the recovery. Raises CapsUnavailable when Redis cannot say."""
        own_only = not restore and self.recovering_s(target, subnet) > 0
        try:
            return await self.subnets.take(target, job_id, worker, subnet, self.ttl_s, own_only)
        except CapsUnavailable:
            self._failed(target, subnet)
            raise

    async def unhold_subnet(self, target: str, job_id: str, worker: str, subnet: str) -> None:
        """Drop the hold an ask took that led to no lease."""
        try:
            await self.subnets.drop_member(target, job_id, worker, subnet)
        except CapsUnavailable as exc:
            log.warning("could not drop %s's subnet hold (it expires): %s", job_id, exc)

    async def keep_subnet(self, target: str, job_id: str, worker: str, subnet: str) -> bool:
        """Lengthen the job's subnet hold with its renewed lease; False when it was
        missing (True when Redis could not say)."""
        try:
            return await self.subnets.keep(target, job_id, worker, subnet, self.ttl_s)
        except CapsUnavailable as exc:
            log.warning("could not extend %s's subnet hold: %s", job_id, exc)
            self._failed(target, subnet)
            return True

    async def take(self, target: str, job_id: str, cap: int) -> Taken:
        """A place for ``job_id`` under ``cap``; raises CapsUnavailable when Redis
        cannot say."""
        return await self.caps.take(target, job_id, cap, self.ttl_s)

    async def keep(self, target: str, job_id: str, restore: bool = False) -> bool:
        """Extend the job's place with its renewed lease; with ``restore``, put it back
        if it is missing. False when the place was missing (True when Redis could not
        say: there is nothing to restore then)."""
        try:
            return await self.caps.keep(target, job_id, self.ttl_s, restore)
        except CapsUnavailable as exc:
            # The lease itself was renewed: the job goes on; only the count may lag.
            log.warning("could not extend %s's place under its cap: %s", job_id, exc)
            return True

    async def free_place(self, target: str, job_id: str) -> None:
        """Free only the job's place (the ask that took it led to no lease)."""
        try:
            await self.caps.drop(target, job_id)
        except CapsUnavailable as exc:
            log.warning("could not free %s's place (it expires with the lease): %s", job_id, exc)

    async def free_lease(self, target: str, job_id: str, worker: str, subnet: str) -> None:
        """Free the place and the subnet hold of a released or revoked lease now; the
        hold of another worker granted the job since then stays (``subnet`` '': none)."""
        try:
            await self.caps.drop(target, job_id)
            if subnet:
                await self.subnets.drop_member(target, job_id, worker, subnet)
        except CapsUnavailable as exc:
            log.warning("could not free %s's place (it expires with the lease): %s", job_id, exc)

    async def free(self, target: str, job_id: str) -> None:
        """Free the job's place and all its subnet holds now (it settled): one round
        trip, two on a Redis Cluster."""
        try:
            if self._free_settled is None:
                await self.caps.drop(target, job_id)
                await self.subnets.drop(target, job_id)
                return
            keys = [inflight_caps.KEY_PREFIX + target, subnet_holds.KEY_PREFIX + target]
            try:
                await self._free_settled(keys=keys, args=[job_id])
            except RedisError as exc:
                raise CapsUnavailable(f"redis: {exc}") from exc
        except CapsUnavailable as exc:
            log.warning("could not free %s's place (it expires with the lease): %s", job_id, exc)

    async def counts(self) -> dict[str, int]:
        """Places held now by each target (raises CapsUnavailable)."""
        return await self.caps.counts(self.targets)

    async def reachable(self) -> bool:
        """Whether Redis answers."""
        return await self.caps.reachable()

    async def close(self) -> None:
        """Close the Redis connections."""
        await self.caps.close()
