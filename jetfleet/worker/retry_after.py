"""Retry-After as a target sends it (seconds or an HTTP-date), and the bound on it.

The HTTP-date form is turned into a duration against the response's own ``Date`` header,
never against this worker's clock: the target's clock and ours may disagree by any amount
(I9), but the two dates of one response come from the same clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from email.utils import parsedate_to_datetime


def retry_after_s(value: str | None, date: str | None) -> float | None:
    """How many seconds a ``Retry-After`` header asks for.

    Args:
        value: the header as sent: delta-seconds (``"120"``) or an HTTP-date.
        date: the same response's ``Date`` header, needed for the HTTP-date form.

    Returns:
        Seconds (0 for a date already past), or None when the header is absent or cannot
        be read, or is a date with no ``Date`` to measure it from (the retry policy's
        backoff applies then).
    """
    if value is None:
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        seconds = float(text)
    except ValueError:
        return _date_difference(text, date)
    # A float is not the header's grammar, but its meaning is plain; nan/inf is not.
    return max(0.0, seconds) if math.isfinite(seconds) else None


def _date_difference(retry_at: str, date: str | None) -> float | None:
    if date is None:
        return None
    try:
        later, now = parsedate_to_datetime(retry_at), parsedate_to_datetime(date)
        return max(0.0, (later - now).total_seconds())
    except (TypeError, ValueError):
        # Unreadable, or one date has a zone and the other not (they cannot be compared).
        return None


@dataclass(frozen=True)
class BoundedWait:
    """A wait a target asked for, and what the worker honours of it."""

    asked_s: float
    """What the target asked for."""
    cap_s: float
    """The target's ``max_retry_after_s``."""

    @property
    def delay_s(self) -> float:
        """How long the job and the target are left alone: the ask, at most the cap."""
        return min(self.asked_s, self.cap_s)

    @property
    def over_cap(self) -> bool:
        """Whether the target asked for longer than the worker waits (a target hold)."""
        return self.asked_s > self.cap_s

    def describe(self, target: str) -> str:
        """One line for the attempt's detail: what was asked and what is honoured."""
        return (
            f"Retry-After {self.asked_s:g} s is over targets.{target}.max_retry_after_s "
            f"({self.cap_s:g} s): the job waits {self.cap_s:g} s, the target is held"
        )
