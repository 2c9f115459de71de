"""Quarantine rules as counts over sliding windows: pure, no I/O, no clock.

Every time here is an event's own time: when the NATS server stored its outcome event
(``msg.metadata.timestamp``), never this host's clock, so a service that is slow, restarts
and reads the stream again, or runs on a skewed host counts exactly the same windows.

The window that ends with an event at ``t`` holds the events of its key at times in
``(t - window_s, t]``: an event exactly ``window_s`` older is outside. A rule fires on the
event that brings its key's count to ``count``; the key's window then starts empty, so
the same evidence never fires twice.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from jetfleet.schemas import Outcome

from jetfleet.settings import QuarantineRule


@dataclass(frozen=True)
class Seen:
    """One outcome event as the rules see it."""

    at_s: float
    """When the server stored it (POSIX seconds)."""
    seq: int
    """Its sequence in ``JF_OUTCOMES``."""
    outcome: Outcome


@dataclass(frozen=True)
class Firing:
    """A rule met: quarantine ``name`` (a worker or identity) on ``target``."""

    rule: QuarantineRule
    name: str
    target: str
    evidence: tuple[Seen, ...]
    """The events in the window, oldest first (``rule.count`` of them)."""


@dataclass
class EventWindow:
    """One key's events in its sliding window, oldest first (by stream sequence)."""

    events: deque[Seen] = field(default_factory=deque)
    newest_s: float = float("-inf")
    """The newest event time seen: where the window ends."""

    def add(self, seen: Seen, window_s: float) -> bool:
        """Add ``seen`` (once: a redelivered event is not counted again) and drop what
        fell out of ``(newest - window_s, newest]``; whether it was added."""
        if any(e.seq == seen.seq for e in self.events):
            return False
        self.events.append(seen)
        self.trim(seen.at_s, window_s)
        return True

    def trim(self, at_s: float, window_s: float) -> None:
        """Drop the events older than the window ending at the newest of ``at_s`` and
        the times seen before."""
        # Stream order is storage order, but times from a new stream leader may step
        # back a little: the window ends at the newest time seen, not the last one read.
        self.newest_s = max(self.newest_s, at_s)
        start_s = self.newest_s - window_s
        self.events = deque(sorted((e for e in self.events if e.at_s > start_s), key=_seq))

    def put_back(self, events: list[Seen], window_s: float) -> None:
        """Put ``events`` back beside the window's own, each once, in sequence order."""
        kept = events + list(self.events)
        self.events = deque(sorted({e.seq: e for e in kept}.values(), key=_seq))
        if kept:
            self.trim(max(e.at_s for e in kept), window_s)


def _seq(seen: Seen) -> int:
    return seen.seq


class RuleWindows:
    """Each rule's window per (worker or identity, target)."""

    def __init__(self, rules: tuple[QuarantineRule, ...]) -> None:
        self.rules = rules
        self._windows: dict[tuple[int, str, str], EventWindow] = {}

    def observe(self, seen: Seen) -> list[Firing]:
        """Count one event in every rule it matches; the rules it makes fire."""
        event = seen.outcome
        if event.kind != "blocked":
            return []
        fired = []
        for n, rule in enumerate(self.rules):
            name = event.identity if rule.scope == "identity" else event.worker
            if event.reason not in rule.reasons or not name:
                continue
            window = self._windows.setdefault((n, name, event.target), EventWindow())
            if self._count(window, rule, seen):
                fired.append(Firing(rule, name, event.target, tuple(window.events)))
                window.events.clear()
        return fired

    def restore(self, firing: Firing, after_seq: int) -> None:
        """Put back a firing's events newer than ``after_seq``: the firing was not taken
        (its oldest evidence fired before), so only the events that did fire leave the
        window, and the newer ones count towards the next firing."""
        n = next(i for i, rule in enumerate(self.rules) if rule is firing.rule)
        window = self._windows.setdefault((n, firing.name, firing.target), EventWindow())
        window.put_back([e for e in firing.evidence if e.seq > after_seq], firing.rule.window_s)

    def _count(self, window: EventWindow, rule: QuarantineRule, seen: Seen) -> bool:
        """Add ``seen`` to ``window`` (once: a redelivered event is not counted again)
        and drop what fell out; whether the rule's count is met."""
        return window.add(seen, rule.window_s) and len(window.events) >= rule.count

    @property
    def tracked(self) -> int:
        """How many (rule, scope, target) windows are kept."""
        return len(self._windows)

    def forget_before(self, at_s: float) -> None:
        """Drop the windows whose newest event is older than the longest rule's window
        before ``at_s``: nothing in them can count again, and the map must not grow with
        every name ever seen."""
        longest = max((r.window_s for r in self.rules), default=0.0)
        stale = [k for k, w in self._windows.items() if w.newest_s <= at_s - longest]
        for key in stale:
            del self._windows[key]
