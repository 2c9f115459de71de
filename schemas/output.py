"""What a handler produced, as a tagged union (one tag per kind of handler output)."""

from __future__ import annotations

import msgspec


class HttpFetch(msgspec.Struct, frozen=True, tag="http", omit_defaults=True):
    """The record of one HTTP fetch."""

    status: int
    final_url: str
    headers: dict[str, str] = {}
    body_sha256: str = ""
    body_bytes: int = 0
    body: str | None = None
    """The body as text, only when the job asked for it (``store_body``)."""
    truncated: bool = False


class NoopOutput(msgspec.Struct, frozen=True, tag="noop"):
    """The no-op handler's output (benchmarks and tests)."""


class DataOutput(msgspec.Struct, frozen=True, tag="data"):
    """Free-form output of a user handler."""

    data: dict[str, str | int | float | bool | None] = {}


HandlerOutput = HttpFetch | NoopOutput | DataOutput
