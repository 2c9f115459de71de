"""Bounded, in-memory tallies of outcome events for the dashboard: per version tuple id a
success-rate series over time, and per worker, identity and target the recent totals.

Every tally is kept in ``BUCKET_S`` buckets, only those of the last ``BUCKETS`` buckets'
time (15 minutes) by the server's clock, and at most ``MAX_KEYS`` keys per family (the
least recently seen is dropped first), so the memory is bounded whatever the fleet sends.
A key with no event in that window is dropped when read, so a gateway that has run for
hours shows what one started a minute ago shows (it read the same 15 minutes). Times are
the server's stored timestamps of the events (seconds), never the gateway's own clock, so
every replica that read the same events draws the same chart. The tallies are a cache: a
gateway that restarts reads the last ``window_s`` of ``JF_OUTCOMES`` again
(``outcome_tail.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

import msgspec
from jetfleet.schemas import Outcome

BUCKET_S = 10.0
"""Width of one bucket, seconds: one point of the per-version chart."""
BUCKETS = 90
"""Buckets kept per key: 15 minutes of history."""
MAX_KEYS = 256
"""Keys kept per family (version tuples, workers, identities, targets)."""
RATE_WINDOW_S = 10.0
"""The window the "current rate" of a target is averaged over."""

Family = Literal["version", "worker", "identity", "target"]
FAMILIES: tuple[Family, ...] = ("version", "worker", "identity", "target")


class Tally(msgspec.Struct):
    """Outcomes counted: ``ok`` successes, ``blocked`` blocks, ``failed`` the rest
    (retryable and permanent); ``called`` those that sent a request to the target."""

    ok: int = 0
    blocked: int = 0
    failed: int = 0
    called: int = 0

    @property
    def total(self) -> int:
        """Every outcome counted."""
        return self.ok + self.blocked + self.failed

    def add(self, other: Tally) -> None:
        """Add ``other`` into this one."""
        self.ok += other.ok
        self.blocked += other.blocked
        self.failed += other.failed
        self.called += other.called


class Point(msgspec.Struct, frozen=True):
    """One bucket of a version's chart: its start (server time, s) and its counts."""

    t: float
    ok: int
    total: int


class Row(msgspec.Struct, frozen=True):
    """One key's totals over the buckets kept, and when it was last seen (server s)."""

    name: str
    ok: int
    blocked: int
    failed: int
    last_s: float


def window_start(now_s: float) -> int:
    """The index of the oldest bucket inside the window that ends at ``now_s``."""
    return int(now_s // BUCKET_S) - BUCKETS + 1


def _tally_of(event: Outcome) -> Tally:
    kind = event.kind
    return Tally(
        ok=int(kind == "ok"),
        blocked=int(kind == "blocked"),
        failed=int(kind in ("retryable", "permanent")),
        called=int(event.called),
    )


class _Keyed:
    """Buckets per key, bounded in keys and buckets."""

    def __init__(self) -> None:
        self.keys: OrderedDict[str, OrderedDict[int, Tally]] = OrderedDict()
        self.last_s: dict[str, float] = {}

    def add(self, key: str, at_s: float, tally: Tally) -> None:
        buckets = self.keys.pop(key, None) or OrderedDict()
        self.keys[key] = buckets  # most recently seen last
        index = int(at_s // BUCKET_S)
        bucket = buckets.get(index)
        if bucket is None:
            late = bool(buckets) and index < next(reversed(buckets))
            bucket = buckets[index] = Tally()
            # Events come in stream order, so a new bucket is nearly always the newest;
            # sort only when one arrives late (judged before it was added), then drop the
            # oldest past the bound.
            if late:
                ordered = sorted(buckets.items())
                buckets.clear()
                buckets.update(ordered)
            while len(buckets) > BUCKETS:
                buckets.popitem(last=False)
        bucket.add(tally)
        self.last_s[key] = max(self.last_s.get(key, 0.0), at_s)
        while len(self.keys) > MAX_KEYS:
            dropped, _ = self.keys.popitem(last=False)
            self.last_s.pop(dropped, None)

    def prune(self, now_s: float) -> None:
        """Drop the buckets older than the window ending at ``now_s``, and the keys left
        with none."""
        first = window_start(now_s)
        for key in list(self.keys):
            buckets = self.keys[key]
            while buckets and next(iter(buckets)) < first:
                buckets.popitem(last=False)
            if not buckets:
                del self.keys[key]
                self.last_s.pop(key, None)

    def rows(self) -> list[Row]:
        rows = []
        for key, buckets in self.keys.items():
            sum_ = Tally()
            for tally in buckets.values():
                sum_.add(tally)
            rows.append(Row(key, sum_.ok, sum_.blocked, sum_.failed, self.last_s[key]))
        return sorted(rows, key=lambda r: r.name)


class OutcomeSeries:
    """The tallies the dashboard draws, fed one event at a time."""

    def __init__(self) -> None:
        self._families: dict[Family, _Keyed] = {family: _Keyed() for family in FAMILIES}
        self.events = 0
        """Events counted since the gateway started."""
        self.newest_s = 0.0
        """The newest event's stored time (server s; 0: none yet)."""

    def add(self, event: Outcome, at_s: float) -> None:
        """Count ``event``, stored by the server at ``at_s`` (epoch seconds)."""
        tally = _tally_of(event)
        keys: dict[Family, str] = {
            "version": event.versions.id or "(no id)",
            "worker": event.worker,
            "identity": event.identity,
            "target": event.target,
        }
        for family, key in keys.items():
            if key:  # a worker without an identity has no identity row
                self._families[family].add(key, at_s, tally)
        self.events += 1
        self.newest_s = max(self.newest_s, at_s)

    def rows(self, family: Family, now_s: float) -> list[Row]:
        """Every key of ``family`` seen in the window ending at ``now_s`` (server s), with
        its totals over that window, by name."""
        keyed = self._families[family]
        keyed.prune(now_s)
        return keyed.rows()

    def series(self, now_s: float) -> dict[str, list[Point]]:
        """Per version tuple id seen in the window ending at ``now_s`` (server s), its
        buckets in that window oldest first (only buckets with events)."""
        self._families["version"].prune(now_s)
        return {
            key: [Point(index * BUCKET_S, t.ok, t.total) for index, t in buckets.items()]
            for key, buckets in sorted(self._families["version"].keys.items())
        }

    def rates(self, now_s: float) -> dict[str, float]:
        """Requests per second each target was sent over the ``RATE_WINDOW_S`` before
        ``now_s`` (server s), counted from outcomes that called the target. Whole
        buckets only, so the figure moves in steps of one bucket."""
        newest_whole = int(now_s // BUCKET_S)  # the bucket in progress is left out
        first = newest_whole - int(RATE_WINDOW_S // BUCKET_S)
        rates: dict[str, float] = {}
        for key, buckets in self._families["target"].keys.items():
            called = sum(t.called for i, t in buckets.items() if first <= i < newest_whole)
            rates[key] = round(called / RATE_WINDOW_S, 3)
        return rates
