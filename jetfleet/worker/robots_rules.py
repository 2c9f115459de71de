"""What a target's robots.txt allows, read from its ``RobotsRecord`` (RFC 9309, parsed
with Protego). Pure: no I/O, so every rule here is tested without a server.

How a fetch's answer is read (RFC 9309 section 2.3.1):

- 2xx: the body is obeyed (cut at 500 KiB), with the group of the User-Agent the fleet
  sends; a specific group replaces ``*`` entirely.
- 3xx left unresolved (a redirect off the target, or more than five) and 4xx, 404
  included: "unavailable", everything is allowed.
- 5xx, or no answer at all (network error, timeout; status 0): "unreachable",
  everything is disallowed for a while (``fleet.robots_error_hold_s``), and then
  robots.txt is asked again. Jobs wait meanwhile; none is dead-lettered for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from protego import Protego

from jetfleet.schemas.targets import MAX_ROBOTS_CHARS, RobotsRecord

log = logging.getLogger(__name__)

ROBOTS_DISALLOWED = "robots-disallowed"
"""The dead letter reason of a job whose URL robots.txt disallows (permanent, unsent)."""
ROBOTS_UNAVAILABLE = "robots-unavailable"
"""The hand-back reason while a target is held after its robots.txt answered 5xx or
could not be fetched."""
ERROR_CHARS = 256


def robots_url(base_url: str) -> str:
    """The robots.txt of ``base_url``'s scheme, host and port (never under its path)."""
    parts = urlsplit(base_url)
    return urlunsplit((parts.scheme, parts.netloc, "/robots.txt", "", ""))


MAX_DELAY_S = 86400.0
"""The longest Crawl-delay or Request-rate interval read (one request a day)."""


def robots_text(body: bytes) -> str:
    """``body`` as the text to parse: its first 500 KiB (RFC 9309 section 2.5), UTF-8
    with undecodable bytes replaced (a rule is ASCII; a broken byte must not hide it)."""
    return body[:MAX_ROBOTS_CHARS].decode("utf-8", errors="replace")[:MAX_ROBOTS_CHARS]


def obeyed(status: int) -> bool:
    """Whether a robots.txt answered with ``status`` is read for its rules (2xx)."""
    return 200 <= status < 300


def unreachable(status: int) -> bool:
    """Whether ``status`` means disallow everything for a while: 5xx, 429 (the site asks
    to slow down: read as allow-all, it would lift its rules for a whole cache period),
    or 0 (no answer)."""
    return status in (0, 429) or status >= 500


def record_of_answer(
    target: str, status: int, body: bytes, user_agent: str, fetched_by: str, error: str = ""
) -> RobotsRecord:
    """The record of a robots.txt fetch that got an answer, with the Crawl-delay and
    Request-rate that apply to ``user_agent`` (the one the fleet sends this target)."""
    error = _short(error)
    if not obeyed(status):
        return RobotsRecord(target=target, status=status, fetched_by=fetched_by, error=error)
    text = robots_text(body)
    parser = _parse(text)
    return RobotsRecord(
        target=target,
        status=status,
        body=text,
        crawl_delay_s=_crawl_delay_s(parser, user_agent),
        request_interval_s=_request_interval_s(parser, user_agent),
        fetched_by=fetched_by,
        error=error,
    )


def record_of_failure(target: str, error: str, fetched_by: str) -> RobotsRecord:
    """The record of a robots.txt fetch that got no answer (status 0: disallow all)."""
    return RobotsRecord(target=target, status=0, fetched_by=fetched_by, error=_short(error))


@dataclass(frozen=True)
class RobotsRules:
    """A record made ready to judge URLs (parsed once)."""

    record: RobotsRecord
    parser: Protego | None
    """None: no rules to read (everything is allowed, or everything is held)."""

    @classmethod
    def of(cls, record: RobotsRecord) -> RobotsRules:
        """The rules of ``record``."""
        return cls(record, _parse(record.body) if obeyed(record.status) else None)

    @property
    def unreachable(self) -> bool:
        """Everything is disallowed for a while (5xx, or the fetch failed)."""
        return unreachable(self.record.status)

    def allows(self, url: str, user_agent: str) -> bool:
        """Whether ``user_agent`` may fetch ``url``. False while unreachable."""
        if self.unreachable:
            return False
        if self.parser is None:
            return True
        return bool(self.parser.can_fetch(url, user_agent))  # URL first (not urllib's order)


def _short(text: str) -> str:
    """``text`` cut to what the record's ``error`` takes (256 characters)."""
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


def _parse(text: str) -> Protego:
    try:
        return Protego.parse(text)
    except Exception as exc:  # Protego is lenient; anything it still chokes on has no rule
        log.warning("robots.txt could not be parsed (%s); read as empty, allowing all", exc)
        return Protego.parse("")


def _crawl_delay_s(parser: Protego, user_agent: str) -> float:
    delay = parser.crawl_delay(user_agent)
    # At most a day: a larger delay would not fit a permit's wait (nor the Lua script).
    return min(MAX_DELAY_S, max(0.0, float(delay))) if delay is not None else 0.0


def _request_interval_s(parser: Protego, user_agent: str) -> float:
    """Seconds per request from Request-rate (``3/10s``: 3.33); its time-of-day window,
    if any, is not read: the rate holds all day, the stricter reading."""
    rate = parser.request_rate(user_agent)
    if rate is None or rate.requests <= 0:
        return 0.0
    return min(MAX_DELAY_S, max(0.0, float(rate.seconds) / float(rate.requests)))
