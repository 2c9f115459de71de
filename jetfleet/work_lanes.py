"""Work lanes: which consumers carry which targets' work.

The first ``fleet.dedicated_targets`` targets declared each get a lane of their own (one
consumer per tier, capped by the server at the target's ``max_in_flight``). Targets
beyond that count are hashed into ``fleet.target_partitions`` shared lanes, so a fleet of
thousands of small targets needs a few dozen consumers and pull loops, not thousands.
A partition's consumer has one filter subject per member target; the leaser caps each
member's in-flight jobs (docs/topology.md).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from jetfleet import subjects
from jetfleet.errors import ConfigError
from jetfleet.settings import Settings

# A partition's unacked window is this many times the sum of its members' caps (which
# the leaser enforces per member): room for the jobs of a member at its cap that are
# handed back, so the consumer still moves on to the other members' jobs.
PARTITION_HEADROOM = 4


@dataclass(frozen=True)
class WorkLane:
    """One target's own consumers, or one partition's shared ones."""

    name: str
    """The target's name, or ``P<k>`` for partition k (never a target name: those are
    lowercase)."""
    targets: tuple[str, ...]
    partition: int | None = None
    max_in_flight: int = 1
    """The consumer's ``max_ack_pending`` per tier."""

    @property
    def shared(self) -> bool:
        """Whether several targets (may) share this lane's consumers."""
        return self.partition is not None

    def consumer(self, tier: str) -> str:
        """The durable consumer of this lane at ``tier``."""
        return f"work-{self.name}-{tier}"

    def filters(self, tier: str) -> list[str]:
        """The work subjects this lane's consumer at ``tier`` takes."""
        return [subjects.work(t, tier) for t in self.targets]


def partition_of(target: str, partitions: int) -> int:
    """The partition a target beyond the dedicated count hashes into (stable across
    processes and Python versions, unlike ``hash()``)."""
    return zlib.crc32(target.encode()) % partitions


def partition_lane_name(partition: int) -> str:
    """The lane name of partition ``partition``."""
    return f"P{partition}"


class LaneMap:
    """The lanes of a fleet's settings, and which lane each target is in."""

    def __init__(self, settings: Settings) -> None:
        fleet = settings.fleet
        names = list(settings.targets)  # declaration order
        own = names[: fleet.dedicated_targets]
        lanes = [
            WorkLane(name=t, targets=(t,), max_in_flight=settings.targets[t].max_in_flight)
            for t in own
        ]
        members: dict[int, list[str]] = {}
        for name in names[fleet.dedicated_targets :]:
            members.setdefault(partition_of(name, fleet.target_partitions), []).append(name)
        for k in sorted(members):
            group = tuple(sorted(members[k]))
            lanes.append(
                WorkLane(
                    name=partition_lane_name(k),
                    targets=group,
                    partition=k,
                    max_in_flight=PARTITION_HEADROOM
                    * sum(settings.targets[t].max_in_flight for t in group),
                )
            )
        self.lanes: tuple[WorkLane, ...] = tuple(lanes)
        self._by_target = {t: lane for lane in lanes for t in lane.targets}

    def lane_of(self, target: str) -> WorkLane:
        """The lane carrying ``target``'s work (KeyError if it is not declared)."""
        return self._by_target[target]

    def is_shared(self, target: str) -> bool:
        """Whether ``target`` is partitioned (its in-flight cap is the leaser's job)."""
        lane = self._by_target.get(target)
        return lane is not None and lane.shared

    def lanes_for(self, targets: Iterable[str]) -> tuple[WorkLane, ...]:
        """The lanes a worker assigned to ``targets`` pulls, in lane order."""
        unknown = sorted(t for t in targets if t not in self._by_target)
        if unknown:
            raise ConfigError(
                f"unknown target(s) {', '.join(unknown)}: declare each as [targets.NAME] "
                "in jetfleet.toml, or leave it out of --targets/worker.targets"
            )
        wanted = {self._by_target[t].name for t in targets}
        return tuple(lane for lane in self.lanes if lane.name in wanted)
