"""A target's activity window: the hours (and days) of a time zone it may be sent work in.

Pure: parsed from ``targets.NAME.active_hours``, ``active_days`` and ``timezone``, and
asked about a moment the caller gives (the leaser gives the NATS server's now, never its
host clock). A span ``"22:00-02:00"`` crosses midnight and belongs to the day it starts
on; ``"00:00-24:00"`` is the whole day. Times are wall-clock times of the zone, so a
span keeps its local hours across a DST change (it is an hour shorter or longer that
day); a span starting in a spring-forward gap opens when the gap ends (01:30 in a
01:00-02:00 gap opens at 02:00, so even a span wholly in the gap opens that day), an end
in a gap is read with the offset before the change (01:40 closes at 02:40), a repeated
time is its first occurrence.
"""

from __future__ import annotations

import datetime
import functools
import re
from dataclasses import dataclass
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
DAY_S = 86400
_TIME_RE = re.compile(r"^([01][0-9]|2[0-4]):([0-5][0-9])(?::([0-5][0-9]))?$")


class WindowError(ValueError):
    """A window setting that cannot be read; the message says what to write instead."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting
        """Which setting: ``active_hours``, ``active_days`` or ``timezone``."""


@dataclass(frozen=True)
class ActivityWindow:
    """When a target may be sent work: ``spans`` (seconds after local midnight, start
    and end; an end at or before its start is on the next day) on ``days`` (0 is
    Monday), in ``zone``."""

    spans: tuple[tuple[int, int], ...]
    days: frozenset[int]
    zone: ZoneInfo

    @classmethod
    def parse(
        cls, hours: tuple[str, ...], days: tuple[str, ...], timezone: str
    ) -> ActivityWindow | None:
        """The window the three settings describe; None when neither hours nor days are
        given (the target is always open).

        Raises:
            WindowError: a span, day or zone that cannot be read, naming which.
        """
        if not hours and not days:
            if timezone:
                _zone(timezone)  # still checked: a typo must not wait for a later edit
            return None
        spans = tuple(_span(text) for text in hours) or ((0, DAY_S),)
        picked = frozenset(_day(text) for text in days) if days else frozenset(range(7))
        return cls(spans, picked, _zone(timezone or "UTC"))

    def opens_in_s(self, now: datetime.datetime) -> float:
        """0 when ``now`` (an aware datetime) is inside the window; else the seconds
        until it next opens."""
        if self._open_at(now):
            return 0.0
        local = now.astimezone(self.zone)
        soonest: float | None = None
        for offset in range(8):
            day = local.date() + datetime.timedelta(days=offset)
            if day.weekday() not in self.days:
                continue
            for start, _ in self.spans:
                wait = (self._opening(day, start) - now).total_seconds()
                if wait > 0 and (soonest is None or wait < soonest):
                    soonest = wait
            if soonest is not None:
                return soonest
        raise AssertionError("a window with a day and a span opens within 8 days")

    def _open_at(self, now: datetime.datetime) -> bool:
        local_day = now.astimezone(self.zone).date()
        for offset in (-1, 0):  # a span that started yesterday may still run
            day = local_day + datetime.timedelta(days=offset)
            if day.weekday() not in self.days:
                continue
            for start, end in self.spans:
                begins = self._opening(day, start)
                ends = self._instant(day, end if end > start else end + DAY_S)
                if begins <= now < ends:
                    return True
        return False

    def _instant(self, day: datetime.date, seconds: int) -> datetime.datetime:
        """The UTC instant of local wall time ``seconds`` after ``day``'s midnight."""
        day = day + datetime.timedelta(days=seconds // DAY_S)
        seconds %= DAY_S
        wall = datetime.datetime.combine(
            day, datetime.time(seconds // 3600, seconds // 60 % 60, seconds % 60)
        )
        # fold=0: a wall time in a spring-forward gap is read with the offset before the
        # change, so it lands as far past the gap's start as it was (01:30 in a 01:00-02:00
        # gap is 02:30); a repeated one (fall back) is its first occurrence.
        return wall.replace(tzinfo=self.zone).astimezone(datetime.UTC)

    def _opening(self, day: datetime.date, seconds: int) -> datetime.datetime:
        """The UTC instant a span starting at local ``seconds`` after ``day``'s midnight
        opens: as ``_instant``, but a start in a spring-forward gap opens when the gap
        ends (01:30 in a 01:00-02:00 gap opens at 02:00), so a span running past the
        gap's end by less than the gap (01:30-02:15) still opens that day."""
        after = self._instant(day, seconds)
        wall = after.astimezone(self.zone).replace(tzinfo=None)
        asked = datetime.datetime.combine(day, datetime.time()) + datetime.timedelta(
            seconds=seconds
        )
        if wall == asked:
            return after  # the wall time exists
        # In a gap: its end is the change of offset (on a whole second), within the
        # gap's length before.
        offset = after.astimezone(self.zone).utcoffset()
        high = int(after.timestamp())
        low = high - int((wall - asked).total_seconds())
        while high - low > 1:
            mid = (low + high) // 2
            instant = datetime.datetime.fromtimestamp(mid, datetime.UTC)
            if instant.astimezone(self.zone).utcoffset() == offset:
                high = mid
            else:
                low = mid
        return datetime.datetime.fromtimestamp(high, datetime.UTC)

    def longest_closed_s(self) -> float:
        """The longest closed spell in wall-clock seconds over a week (a DST change can
        make one an hour longer): what a job waits at most for the window to open."""
        opens: list[tuple[int, int]] = []
        for week in (0, 1):
            for day in sorted(self.days):
                base = (week * 7 + day) * DAY_S
                for start, end in self.spans:
                    stop = end if end > start else end + DAY_S
                    opens.append((base + start, base + stop))
        opens.sort()
        longest = 0
        reach = opens[0][1]
        for start, stop in opens[1:]:
            longest = max(longest, start - reach)
            reach = max(reach, stop)
        # The first week's spans followed by the second's cover every gap of a cycle.
        return float(longest)


def _span(text: str) -> tuple[int, int]:
    parts = text.split("-")
    if len(parts) != 2:
        raise WindowError(
            "active_hours",
            f'span {text!r} is not START-END: write it as "08:00-18:00" (HH:MM or '
            "HH:MM:SS, 24-hour; an end before the start crosses midnight)",
        )
    start, end = (_seconds(part.strip(), text) for part in parts)
    if start == end or start >= DAY_S:
        raise WindowError(
            "active_hours",
            f"span {text!r} is empty or starts at 24:00: give a start from 00:00 to "
            '23:59:59 and a different end ("00:00-24:00" is the whole day)',
        )
    return start, end


def _seconds(part: str, span: str) -> int:
    match = _TIME_RE.match(part)
    if match is None:
        raise WindowError(
            "active_hours",
            f"span {span!r}: {part!r} is not a time: write HH:MM or HH:MM:SS, 24-hour "
            '("08:00", "22:30:15")',
        )
    hours, minutes, seconds = int(match[1]), int(match[2]), int(match[3] or 0)
    if hours == 24 and (minutes or seconds):
        raise WindowError("active_hours", f"span {span!r}: {part!r} is past 24:00")
    return hours * 3600 + minutes * 60 + seconds


def _day(text: str) -> int:
    name = text.strip().lower()
    for number, (short, full) in enumerate(zip(DAYS, _FULL_DAYS, strict=True)):
        if name in (short, full):
            return number
    raise WindowError("active_days", f"day {text!r} is not a day: use {', '.join(DAYS)}")


_FULL_DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")


def _zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise WindowError(
            "timezone",
            f"time zone {name!r} is not known ({exc}): use an IANA name such as "
            '"Europe/Lisbon" or "UTC"',
        ) from None


@functools.lru_cache(maxsize=1024)
def window_of(
    hours: tuple[str, ...], days: tuple[str, ...], timezone: str
) -> ActivityWindow | None:
    """``ActivityWindow.parse``, kept: the leaser asks on every grant."""
    return ActivityWindow.parse(hours, days, timezone)
