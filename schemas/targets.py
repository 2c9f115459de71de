"""Per-target state the fleet shares through KV: limits set at run time
(``jetfleet target set``) and what each target's robots.txt said."""

from __future__ import annotations

from typing import Annotated

import msgspec
from jetfleet.schemas.job import ShortText
from jetfleet.schemas.names import Name

# A robots.txt over 500 KiB is cut there (RFC 9309 section 2.5).
MAX_ROBOTS_CHARS = 500 * 1024
RobotsText = Annotated[str, msgspec.Meta(max_length=MAX_ROBOTS_CHARS)]


class TargetLimits(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """Run-time limits of one target, key ``<target>`` in ``jf-targets``. A field left
    None keeps the value from the config file; every ratelimit replica applies a change
    within a second (a KV watch)."""

    rate: Annotated[float, msgspec.Meta(ge=1 / 86400, le=1e9)] | None = None
    """Requests per second (one a day at least)."""
    burst: Annotated[int, msgspec.Meta(ge=1)] | None = None
    daily: Annotated[int, msgspec.Meta(ge=0)] | None = None
    """Requests per UTC day (by Redis's clock); 0: no budget."""
    set_by: Name = ""
    reason: ShortText = ""


class RobotsRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    """What fetching ``<base_url>/robots.txt`` gave, key ``<target>`` in ``jf-robots``
    (the bucket's max age is the cache's expiry, ``fleet.robots_ttl_s``).

    ``status`` 0 means the fetch failed (network, timeout). RFC 9309: 2xx is obeyed,
    4xx allows everything, 5xx or a failure disallows everything for a while
    (``fleet.robots_error_hold_s``), as a hold, not a dead letter."""

    target: Name
    status: int
    body: RobotsText = ""
    crawl_delay_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """The Crawl-delay for the fleet's User-Agent (0: none); a rate cap of 1/delay."""
    request_interval_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Seconds per request from the Request-rate for the fleet's User-Agent (``1/10s``
    gives 10; 0: none); the ratelimit service caps the target by the stricter of this
    and ``crawl_delay_s``."""
    fetched_by: Name = ""
    error: ShortText = ""
