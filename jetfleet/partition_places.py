"""The in-flight places of a fleet's partitioned targets, as the services keep them.

One object per service (leaser, sink, status) over ``InFlightCaps``: every call is a
no-op for a target with its own lane (the server caps those), and nothing connects to
Redis when no target is partitioned. Keeping and freeing are best effort, since a place
also expires with its lease; only taking one can refuse (docs/topology.md).
"""

from __future__ import annotations

import logging

from jetfleet.inflight_caps import CapsUnavailable, InFlightCaps
from jetfleet.settings import Settings
from jetfleet.work_lanes import LaneMap

log = logging.getLogger(__name__)


class PartitionPlaces:
    """Take, keep, free and count the places of partitioned targets."""

    def __init__(self, settings: Settings) -> None:
        self.lanes = LaneMap(settings)
        self.ttl_s = settings.fleet.lease_ttl_s
        self.targets = [t for lane in self.lanes.lanes if lane.shared for t in lane.targets]
        """The partitioned targets, in lane order."""
        self.caps = InFlightCaps.connect(settings.redis.url) if self.targets else None

    def applies(self, target: str) -> bool:
        """Whether ``target`` is partitioned (its cap is kept here, not by the server)."""
        return self.caps is not None and self.lanes.is_shared(target)

    async def take(self, target: str, job_id: str, cap: int) -> bool:
        """A place for ``job_id`` under ``cap`` (always True for a target with its own
        lane); raises CapsUnavailable when Redis cannot say."""
        if self.caps is None or not self.lanes.is_shared(target):
            return True
        return await self.caps.take(target, job_id, cap, self.ttl_s)

    async def keep(self, target: str, job_id: str) -> None:
        """Extend the job's place with its renewed lease."""
        if self.caps is None or not self.lanes.is_shared(target):
            return
        try:
            await self.caps.keep(target, job_id, self.ttl_s)
        except CapsUnavailable as exc:
            # The lease itself was renewed: the job goes on; only the count may lag.
            log.warning("could not extend %s's place under its cap: %s", job_id, exc)

    async def free(self, target: str, job_id: str) -> None:
        """Free the job's place now (released, revoked or settled)."""
        if self.caps is None or not self.lanes.is_shared(target):
            return
        try:
            await self.caps.drop(target, job_id)
        except CapsUnavailable as exc:
            log.warning("could not free %s's place (it expires with the lease): %s", job_id, exc)

    async def counts(self) -> dict[str, int]:
        """Places held now by each partitioned target (raises CapsUnavailable)."""
        if self.caps is None:
            return {}
        return await self.caps.counts(self.targets)

    async def reachable(self) -> bool:
        """Whether Redis answers (True when no target needs it)."""
        return self.caps is None or await self.caps.reachable()

    async def close(self) -> None:
        """Close the Redis connections, if any."""
        if self.caps is not None:
            await self.caps.close()
