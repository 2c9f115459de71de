"""What a handler produced, as a tagged union (one tag per kind of handler output)."""

from __future__ import annotations

import msgspec
from jetfleet.schemas.browser import PageVisit
from jetfleet.schemas.stored import StoredObject

__all__ = ["DataOutput", "HandlerOutput", "HttpFetch", "NoopOutput", "PageVisit", "StoredObject"]


class HttpFetch(msgspec.Struct, frozen=True, tag="http", omit_defaults=True):
    """The record of one HTTP fetch."""

    status: int
    final_url: str
    headers: dict[str, str] = {}
    body_sha256: str = ""
    body_bytes: int = 0
    body: str | None = None
    """The body as text, only when the job asked for it (``store_body``) and it fits in a
    message (``fleet.max_inline_bytes``); a larger one is in ``body_object``."""
    truncated: bool = False
    """Set only by earlier versions, which cut bodies at the target's ``max_body_bytes``;
    a longer body now fails the job as ``result-too-large``."""
    body_object: StoredObject | None = None
    """Where the body is when the job asked for it and it was too large to carry inline:
    its exact bytes, as the target sent them."""


class NoopOutput(msgspec.Struct, frozen=True, tag="noop"):
    """The no-op handler's output (benchmarks and tests)."""


class DataOutput(msgspec.Struct, frozen=True, tag="data"):
    """Free-form output of a user handler."""

    data: dict[str, str | int | float | bool | None] = {}


HandlerOutput = HttpFetch | NoopOutput | DataOutput | PageVisit
