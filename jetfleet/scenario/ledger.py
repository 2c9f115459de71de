"""What the walkthrough saw: an event log and counters taken from real answers."""

from __future__ import annotations

from collections import Counter

import msgspec

METRIC_ORDER = (
    "grants",
    "grants_refused_profile",
    "grants_refused_quarantine",
    "quarantines",
    "reaped",
    "commits",
    "accepted",
    "rejected_fenced",
    "rejected_expired",
    "requeued",
    "suppressed_dedupe",
    "side_effects",
    "distinct_jobs",
)


class Event(msgspec.Struct):
    """One line of the event log."""

    what: str
    detail: str


class Run(msgspec.Struct):
    """One run of the walkthrough, as ``--json`` prints it."""

    dedupe: bool
    events: list[Event]
    metrics: dict[str, int]
    dead_letter: list[str]
    side_effects: int
    distinct_jobs: int
    over_apply_ratio: float
    notes: list[str] = []


class Ledger:
    """Collects events and counts during one run."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.counts: Counter[str] = Counter()
        self.notes: list[str] = []

    def log(self, what: str, detail: str) -> None:
        """Add an event."""
        self.events.append(Event(what=what, detail=detail))

    def count(self, name: str, n: int = 1) -> None:
        """Count ``n`` more of ``name``."""
        self.counts[name] += n

    def note(self, text: str) -> None:
        """Explain where the real system counts a step differently from the reference."""
        self.notes.append(text)

    def finish(self, dedupe: bool, results: list[str], dead: list[str]) -> Run:
        """Close the run with what the streams hold: results (job ids) and dead letters."""
        distinct = len(set(results))
        self.counts["side_effects"] = len(results)
        self.counts["distinct_jobs"] = distinct
        metrics = {name: self.counts[name] for name in METRIC_ORDER}
        ratio = round(len(results) / distinct, 2) if distinct else 0.0
        return Run(
            dedupe=dedupe,
            events=self.events,
            metrics=metrics,
            dead_letter=dead,
            side_effects=len(results),
            distinct_jobs=distinct,
            over_apply_ratio=ratio,
            notes=self.notes,
        )
