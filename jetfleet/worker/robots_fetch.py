"""One fetch of a target's robots.txt, made after its permit was taken.

Redirects (RFC 9309 section 2.3.1.2 asks to follow at least five) are followed hop by
hop, up to five, and only within the target: to ``base_url``'s own scheme, host and
port, or to a host its ``redirect_hosts`` lists. A redirect anywhere else is not
followed, since that site's caps and consent are not this target's; robots.txt then
counts as unavailable, as after more than five hops: everything is allowed (the 4xx
rule), with the reason in the record's ``error`` and a warning in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from urllib.parse import urljoin, urlsplit

import aiohttp

from jetfleet.schemas.targets import MAX_ROBOTS_CHARS, RobotsRecord
from jetfleet.settings import TargetSettings
from jetfleet.worker.robots_rules import record_of_answer, record_of_failure, robots_url
from jetfleet.worker.target_scope import listed_host

log = logging.getLogger(__name__)

MAX_HOPS = 5
_REDIRECT_STATUS = frozenset({301, 302, 303, 307, 308})


async def fetch_robots(
    session: aiohttp.ClientSession,
    name: str,
    target: TargetSettings,
    user_agent: str,
    worker_id: str,
    hop_permitted: Callable[[], Awaitable[bool]] | None = None,
) -> RobotsRecord:
    """Fetch ``name``'s robots.txt with the fleet's User-Agent; its record, never an
    exception (a failure is a record with status 0). Each redirect hop first awaits
    ``hop_permitted`` (its rate permit); refused, the fetch ends as a failure."""
    url = robots_url(target.base_url)
    headers = {"User-Agent": user_agent, "X-Jetfleet-Worker": worker_id}
    timeout = aiohttp.ClientTimeout(total=target.timeout_s)
    try:
        for hop in range(MAX_HOPS + 1):
            if hop and hop_permitted is not None and not await hop_permitted():
                return record_of_failure(name, f"{url}: no rate permit for the redirect", worker_id)
            async with session.get(
                url, headers=headers, timeout=timeout, allow_redirects=False
            ) as response:
                location = response.headers.get("Location")
                if response.status not in _REDIRECT_STATUS or location is None:
                    body = await _read_at_most(response, MAX_ROBOTS_CHARS)
                    return record_of_answer(name, response.status, body, user_agent, worker_id)
                status = response.status
            next_url = urljoin(url, location)
            if not within_target(next_url, target):
                return _unfollowed(name, status, worker_id, f"{url} redirects to {next_url}")
            url = next_url
        return _unfollowed(name, status, worker_id, f"more than {MAX_HOPS} redirects")
    except TimeoutError:
        why = f"{url}: no answer within {target.timeout_s:g} s"
        return record_of_failure(name, why, worker_id)
    except (aiohttp.ClientError, ValueError) as exc:  # ValueError: a malformed Location
        return record_of_failure(name, f"{url}: {type(exc).__name__}: {exc}", worker_id)


def within_target(url: str, target: TargetSettings) -> bool:
    """Whether a robots.txt redirect to ``url`` stays within the target."""
    here, there = urlsplit(target.base_url), urlsplit(url)
    same_origin = (here.scheme, here.netloc.lower()) == (there.scheme, there.netloc.lower())
    return same_origin or listed_host(url, target.redirect_hosts)


def _unfollowed(name: str, status: int, worker_id: str, what: str) -> RobotsRecord:
    why = f"{what}: not followed, robots.txt taken as unavailable (everything allowed)"
    log.warning(
        "robots.txt of %s: %s; to obey the rules there, point base_url at that site or "
        "list its host in targets.%s.redirect_hosts",
        name,
        why,
        name,
    )
    return record_of_answer(name, status, b"", "", worker_id, error=why)


async def _read_at_most(response: aiohttp.ClientResponse, cap: int) -> bytes:
    """The body's first ``cap`` bytes; the rest is not read."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(64 * 1024):
        chunks.append(chunk)
        size += len(chunk)
        if size >= cap:
            break
    return b"".join(chunks)[:cap]
