"""Canonical URLs and idempotency keys.

A key means "this unit of work is done", so it is derived from what the work is (handler,
pinned identity, canonical URL and query), never from a delivery or a job id. Two
submissions of the same page, however spelled, share a key.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from collections.abc import Mapping
from functools import lru_cache
from urllib.parse import parse_qsl, quote, urlencode, urljoin, urlsplit, urlunsplit

_DEFAULT_PORTS = {"http": 80, "https": 443}
_UNRESERVED = frozenset(string.ascii_letters + string.digits + "-._~")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # RFC 3986 section 3.1


@lru_cache(maxsize=512)
def canonical_url(url: str) -> str:
    """Lower-case scheme and host, default port dropped, path normalised, query sorted,
    fragment removed.

    Remembered for the last few hundred URLs: admission asks for one job's URL three
    times (its check, ``is_under``, its key) and for its target's base URL every time."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"  # IPv6: without brackets "[::1]:80" and "[::1:80]" read alike
    port = parts.port
    netloc = host if port in (None, _DEFAULT_PORTS.get(scheme)) else f"{host}:{port}"
    path = _normalise_path(parts.path or "/")
    query = urlencode(sorted(parse_qsl(parts.query, keep_blank_values=True)))
    return urlunsplit((scheme, netloc, path, query, ""))


def idempotency_key(
    handler: str,
    url: str,
    pin_identity: str = "",
    explicit: str = "",
    args: Mapping[str, str] | None = None,
    store_body: bool = False,
    pin_region: str = "",
) -> str:
    """The key for one unit of work, safe to use as a NATS KV key and subject token.

    An explicit key (for example a payment provider's) wins and is carried unchanged in
    meaning through every retry; otherwise the key is built from the work itself: what
    is fetched (handler, pinned identity, canonical URL) and what is made of it (the
    handler's args, whether the body is kept), so two different jobs never share one.
    A pinned region counts too (a page seen from another region may differ); it is
    added only when set, so every key from before region pins stays what it was.
    """
    if explicit:
        return "x-" + _digest(explicit)
    work = f"{handler}\n{pin_identity}\n{canonical_url(url)}"
    if args:
        work += "\n" + json.dumps(sorted(args.items()))
    if store_body:
        work += "\nstore-body"
    if pin_region:
        work += "\nregion:" + pin_region
    return "u-" + _digest(work)


def _normalise_path(path: str) -> str:
    # Decode only unreserved characters: %2F is not "/", so decoding it would give two
    # different resources one key, and the second would be suppressed as done.
    path = re.sub(r"%(?![0-9A-Fa-f]{2})", "%25", path)

    def fix(match: re.Match[str]) -> str:
        char = chr(int(match.group(1), 16))
        return char if char in _UNRESERVED else "%" + match.group(1).upper()

    path = re.sub(r"%([0-9A-Fa-f]{2})", fix, path)
    return quote(_remove_dot_segments(path), safe="/:@!$&'()*+,;=-._~%")


def _remove_dot_segments(path: str) -> str:
    # RFC 3986 section 5.2.4: "/a/../b" is "/b", and ".." never climbs above the root, so
    # "/page/../secret" cannot pass as a URL under "/page/".
    out: list[str] = []
    segments = path.split("/")
    for n, segment in enumerate(segments):
        last = n == len(segments) - 1
        if segment == ".":
            if last:
                out.append("")
        elif segment == "..":
            if len(out) > 1:
                out.pop()
            if last:
                out.append("")
        else:
            out.append(segment)
    result = "/".join(out)
    return result if result.startswith("/") else "/" + result


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def is_under(url: str, base_url: str) -> bool:
    """Whether ``url`` lies under ``base_url`` (same scheme, host, port; path prefix)."""
    got, base = urlsplit(canonical_url(url)), urlsplit(canonical_url(base_url))
    if (got.scheme, got.netloc) != (base.scheme, base.netloc):
        return False
    prefix = base.path if base.path.endswith("/") else base.path + "/"
    return got.path == base.path or got.path.startswith(prefix)


def resolve_url(base_url: str, url_or_path: str) -> str:
    """``url_or_path`` as given when it is an http(s) URL, else a path under ``base_url``.

    A leading ``/`` does not climb to the host's root: with base ``https://h/catalog/``,
    ``/item/7`` and ``item/7`` are both ``https://h/catalog/item/7``, and ``/a:b`` is a
    path. Without a leading ``/``, a scheme (``ftp:``, ``mailto:``, ``a:b``) makes it a
    URL, left as it is for admission to refuse.
    """
    if url_or_path.lower().startswith(("http://", "https://")):
        return url_or_path
    if not url_or_path.startswith("/") and _SCHEME.match(url_or_path):
        return url_or_path
    base = base_url if base_url.endswith("/") else base_url + "/"
    # "./" keeps a first segment holding ":" a path, not a scheme.
    return urljoin(base, "./" + url_or_path.lstrip("/"))
