"""Canonical URLs and idempotency keys.

A key means "this unit of work is done", so it is derived from what the work is (handler,
pinned identity, canonical URL and query), never from a delivery or a job id. Two
submissions of the same page, however spelled, share a key.
"""

from __future__ import annotations

import hashlib
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

_DEFAULT_PORTS = {"http": 80, "https": 443}


def canonical_url(url: str) -> str:
    """Lower-case scheme and host, default port dropped, path normalised, query sorted,
    fragment removed."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    port = parts.port
    netloc = host if port in (None, _DEFAULT_PORTS.get(scheme)) else f"{host}:{port}"
    path = quote(unquote(parts.path or "/"), safe="/:@!$&'()*+,;=-._~")
    query = urlencode(sorted(parse_qsl(parts.query, keep_blank_values=True)))
    return urlunsplit((scheme, netloc, path, query, ""))


def idempotency_key(
    handler: str, url: str, pin_identity: str = "", explicit: str = ""
) -> str:
    """The key for one unit of work, safe to use as a NATS KV key.

    An explicit key (for example a payment provider's) wins and is carried unchanged in
    meaning through every retry; otherwise the key is built from the work itself.
    """
    if explicit:
        return "x-" + _digest(explicit)
    return "u-" + _digest(f"{handler}\n{pin_identity}\n{canonical_url(url)}")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def is_under(url: str, base_url: str) -> bool:
    """Whether ``url`` lies under ``base_url`` (same scheme, host, port; path prefix)."""
    got, base = urlsplit(canonical_url(url)), urlsplit(canonical_url(base_url))
    if (got.scheme, got.netloc) != (base.scheme, base.netloc):
        return False
    prefix = base.path if base.path.endswith("/") else base.path + "/"
    return got.path == base.path or got.path.startswith(prefix)
