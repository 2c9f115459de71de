"""The circuit breaker's count: distinct identities refused on one target within a
sliding window. Pure, no I/O, no clock.

Times are the events' own (when the NATS server stored them in ``JF_OUTCOMES``), as in
rule_windows.py. The window that ends with an event at ``t`` holds the target's matching
events at times in ``(t - window_s, t]``, ending at the newest time seen. A target opens
on the event that brings its distinct refused identities to ``identities`` (K); its
window then starts empty, so the same evidence never opens it twice. An outcome without
an identity counts as its worker (``worker:<id>``): a fleet of identity-less workers is
still a fleet answering a refusing site worker after worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from jetfleet.services.quarantine.rule_windows import EventWindow, Seen

from jetfleet.settings import BreakerSettings


def refused_as(seen: Seen) -> str:
    """Who a refusal counts against: its identity, or its worker if it has none."""
    event = seen.outcome
    return event.identity or f"worker:{event.worker}"


@dataclass(frozen=True)
class Opening:
    """K distinct identities refused on ``target`` within the window."""

    target: str
    identities: tuple[str, ...]
    """The distinct identities, in the order they were first refused."""
    evidence: tuple[Seen, ...]
    """The window's events, oldest first (K or more: one identity may be refused twice)."""


class BreakerWindows:
    """One window per target of the refusals the breaker counts."""

    def __init__(self, settings: BreakerSettings) -> None:
        self.settings = settings
        self._windows: dict[str, EventWindow] = {}

    def counts(self, seen: Seen) -> bool:
        """Whether the breaker counts this event: a ``blocked`` outcome with a reason in
        ``on``."""
        event = seen.outcome
        return event.kind == "blocked" and event.called and event.reason in self.settings.reasons

    def observe(self, seen: Seen) -> Opening | None:
        """Count one event; the opening it makes, if it brings the target to K."""
        if not self.settings.enabled or not self.counts(seen):
            return None
        window = self._windows.setdefault(seen.outcome.target, EventWindow())
        if not window.add(seen, self.settings.window_s):
            return None  # redelivered: counted once
        names = list(dict.fromkeys(refused_as(e) for e in window.events))
        if len(names) < self.settings.identities:
            return None
        opening = Opening(seen.outcome.target, tuple(names), tuple(window.events))
        window.events.clear()
        return opening

    def restore(self, opening: Opening, after_seq: int) -> None:
        """Put back an opening's events newer than ``after_seq``: the opening was not
        taken (its oldest evidence opened the breaker before), so the newer events count
        towards the next one."""
        window = self._windows.setdefault(opening.target, EventWindow())
        window.put_back([e for e in opening.evidence if e.seq > after_seq], self.settings.window_s)

    @property
    def tracked(self) -> int:
        """How many targets' windows are kept."""
        return len(self._windows)

    def forget_before(self, at_s: float) -> None:
        """Drop the windows whose newest event is a whole window older than ``at_s``."""
        stale = [t for t, w in self._windows.items() if w.newest_s <= at_s - self.settings.window_s]
        for target in stale:
            del self._windows[target]
