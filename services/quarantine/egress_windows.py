"""Egress proposals as counts of distinct identities over sliding windows: pure, no I/O,
no clock.

Several identities of one subnet blocked by one target in a short time point at the
subnet (its egress), not at any one identity. Per (subnet, target), the window that ends
with an event at ``t`` holds the matching events at times in ``(t - window_s, t]`` (an
event exactly ``window_s`` older is outside); times are when the NATS server stored each
event, as in ``rule_windows``. The event that brings the window to ``identities``
distinct identities fires; the window then starts empty, so the same evidence never
fires twice.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from jetfleet.services.quarantine.rule_windows import Seen

from jetfleet.settings import EgressRule


@dataclass(frozen=True)
class EgressFiring:
    """Enough identities of ``subnet`` blocked on ``target``: propose an egress quarantine."""

    subnet: str
    target: str
    evidence: tuple[Seen, ...]
    """The events in the window, oldest first (stream order)."""

    @property
    def identities(self) -> list[str]:
        """The distinct identities of the evidence, sorted."""
        return sorted({seen.outcome.identity for seen in self.evidence})


@dataclass
class _Subnet:
    events: deque[Seen] = field(default_factory=deque)
    newest_s: float = float("-inf")


class EgressWindows:
    """The egress rule's window per (subnet, target)."""

    def __init__(self, rule: EgressRule) -> None:
        self.rule = rule
        self._windows: dict[tuple[str, str], _Subnet] = {}

    def observe(self, seen: Seen) -> EgressFiring | None:
        """Count one event; the firing it makes, if any."""
        event = seen.outcome
        if (
            self.rule.identities == 0
            or event.kind != "blocked"
            or event.reason not in self.rule.reasons
            or not event.subnet
            or not event.identity
        ):
            return None
        window = self._windows.setdefault((event.subnet, event.target), _Subnet())
        if any(e.seq == seen.seq for e in window.events):
            return None  # redelivered: counted once
        window.events.append(seen)
        # As in rule_windows: the window ends at the newest time seen, so an event a new
        # stream leader stamps a little earlier counts where it belongs.
        window.newest_s = max(window.newest_s, seen.at_s)
        start_s = window.newest_s - self.rule.window_s
        window.events = deque(
            sorted((e for e in window.events if e.at_s > start_s), key=lambda e: e.seq)
        )
        if len({e.outcome.identity for e in window.events}) < self.rule.identities:
            return None
        firing = EgressFiring(event.subnet, event.target, tuple(window.events))
        window.events.clear()
        return firing

    def restore(self, firing: EgressFiring, after_seq: int) -> None:
        """Put back a firing's events newer than ``after_seq`` (the fired marker): they did
        not fire it before, so they count towards the next firing."""
        window = self._windows.setdefault((firing.subnet, firing.target), _Subnet())
        kept = [e for e in firing.evidence if e.seq > after_seq] + list(window.events)
        window.events = deque(sorted({e.seq: e for e in kept}.values(), key=lambda e: e.seq))
        window.newest_s = max([window.newest_s, *(e.at_s for e in kept)])

    @property
    def tracked(self) -> int:
        """How many (subnet, target) windows are kept."""
        return len(self._windows)

    def forget_before(self, at_s: float) -> None:
        """Drop the windows whose newest event is a whole window older than ``at_s``."""
        stale = [k for k, w in self._windows.items() if w.newest_s <= at_s - self.rule.window_s]
        for key in stale:
            del self._windows[key]
