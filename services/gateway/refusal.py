"""The refusal a gateway route raises for an expected "no": the middleware answers it as
JSON ``{"error": message, ...extra}`` with its status and headers."""

from __future__ import annotations

from typing import Any


class Refused(Exception):
    """An expected refusal a handler raises; the middleware answers it as JSON."""

    def __init__(
        self, status: int, message: str, headers: dict[str, str] | None = None, **extra: Any
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}
        self.extra = extra
