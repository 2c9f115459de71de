"""A job as submitted, and the work order the scheduler routes to a target."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from jetfleet.schemas.browser import PageSpec

Tier = Literal["high", "normal", "bulk"]

# A job id is a KV key and a subject token run: no leading or trailing dot, no "..".
JobId = Annotated[
    str,
    msgspec.Meta(pattern=r"^(?!.*\.\.)[A-Za-z0-9](?:[A-Za-z0-9_=.-]{0,126}[A-Za-z0-9_=-])?$"),
]
ShortText = Annotated[str, msgspec.Meta(max_length=256)]
MAX_URL_CHARS = 8192
Url = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_URL_CHARS)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=86400)]


class Job(msgspec.Struct, frozen=True, omit_defaults=True):
    """One logical unit of work, published to ``jf.submit.<target>``.

    ``timeout_s`` is a duration; a job never carries a wall-clock deadline (I9). Unknown
    fields are refused at admission (a typo must not pass silently) but tolerated when a
    Job is decoded inside other messages, so a new field can roll out service by service.
    """

    id: JobId
    """Client-chosen job id (letters, digits, ``_ = . -``, at most 128, starting with a
    letter or digit, not ending in or doubling a dot). One id is one job: a later
    submission of an id whose job still has state is refused (``duplicate-job-id``)."""
    url: Url
    """The page: an absolute http(s) URL under the target's base_url, or a path that
    admission resolves against it (``/item/7`` and ``item/7`` alike go under base_url)."""
    handler: ShortText = "http.get"
    tier: Tier = "normal"
    max_attempts: Annotated[int, msgspec.Meta(ge=0, le=100)] = 0
    """Retry budget; 0 takes the target's, and it is capped by the target's."""
    idempotency_key: ShortText = ""
    """An explicit key meaning "this unit of work is done"; empty derives one from the URL."""
    pin_identity: ShortText = ""
    """Only a worker owning this identity may run the job."""
    pin_region: ShortText = ""
    """Only a worker of this region (``worker.region``) may run the job."""
    store_body: bool = False
    timeout_s: Seconds = 0.0
    """Per-attempt time budget; 0 takes the target's."""
    args: dict[ShortText, str] = {}
    page: PageSpec | None = None
    """What a ``browser.page`` job waits for, reads and keeps of its page (docs/browser.md)."""


class WorkOrder(msgspec.Struct, frozen=True, omit_defaults=True):
    """A validated job as the scheduler routes it to ``jf.work.<target>.<tier>``: its
    ``job.url`` is absolute (a submitted path resolved) and its ``job.id`` is set (one
    given at admission when the submission had none)."""

    job: Job
    target: str
    key: str
    """The idempotency key, canonical: the same unit of work always gets the same key."""
    max_attempts: int
    timeout_s: Annotated[float, msgspec.Meta(ge=0, le=86400)]
