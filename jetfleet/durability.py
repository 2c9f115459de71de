"""Does the NATS deployment keep what must never be lost? (docs/cluster.md)

Production wants every stream, consumer and bucket replicated on three nodes
(``nats.replicas = 3``) and every server syncing each write to disk before it
acknowledges it (``jetstream { sync_interval: always }``): Jepsen's analysis of NATS
2.12.1 lost acknowledged writes with the default (a sync every 2 minutes, acks before
the sync) when the nodes lost power together.

What can honestly be checked from a client:

* replicas: the setting, and what the live streams and buckets have (declaration never
  raises the replicas of an existing bucket);
* sync: only through each server's monitoring endpoint (``/varz``, on the port of the
  server's ``http:`` setting), listed in ``nats.monitor_url``. No client API tells it,
  so without that setting the sync is reported as not checked, never assumed.

Used by ``jetfleet serve`` (one line at start) and ``jetfleet doctor``.
"""

from __future__ import annotations

import asyncio
from typing import Literal

import aiohttp
import msgspec
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from jetfleet import subjects
from jetfleet.settings import Settings

RECOMMENDED_REPLICAS = 3
DOCS = "docs/cluster.md"
KEPT_SAFE = (
    subjects.STREAM_WORK,
    subjects.STREAM_SUBMIT,
    subjects.STREAM_RESULTS,
    subjects.STREAM_DLQ,
    f"KV_{subjects.BUCKET_LEASES}",
    f"KV_{subjects.BUCKET_FENCES}",
)
"""The streams whose loss loses jobs, commits, fences or dedupe keys: checked live."""
_VARZ_TIMEOUT_S = 2.0

FindingCode = Literal[
    "replicas-below-3", "stream-replicas-below-3", "sync-not-always", "sync-unreadable"
]


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    """Something below what docs/cluster.md recommends for production, and what to set."""

    code: FindingCode
    message: str


class ServerSync(msgspec.Struct, frozen=True, kw_only=True):
    """One server's JetStream sync setting, as its ``/varz`` gave it."""

    monitor_url: str
    server_name: str = ""
    sync_always: bool | None = None
    """None: the endpoint did not answer (``error`` says why)."""
    sync_interval_s: float = 0.0
    error: str = ""


def monitor_urls(settings: Settings) -> list[str]:
    """The monitoring endpoints ``nats.monitor_url`` lists (comma-separated)."""
    return [u.strip().rstrip("/") for u in settings.nats.monitor_url.split(",") if u.strip()]


def replica_findings(settings: Settings) -> list[Finding]:
    """``nats.replicas`` below 3."""
    replicas = settings.nats.replicas
    if replicas >= RECOMMENDED_REPLICAS:
        return []
    return [
        Finding(
            code="replicas-below-3",
            message=f"nats.replicas = {replicas}: streams, consumers and buckets have one "
            f"copy; one lost disk loses fences, dedupe keys and jobs. On a 3-node cluster "
            f"set nats.replicas = 3 (JETFLEET_NATS__REPLICAS=3) before the first start "
            f"({DOCS})",
        )
    ]


async def live_replica_findings(js: JetStreamContext) -> list[Finding]:
    """Streams and buckets in ``KEPT_SAFE`` that exist with fewer than 3 replicas."""
    found = []
    for stream in KEPT_SAFE:
        try:
            info = await js.stream_info(stream)
        except NotFoundError:
            continue
        replicas = info.config.num_replicas or 1
        if replicas < RECOMMENDED_REPLICAS:
            found.append(
                Finding(
                    code="stream-replicas-below-3",
                    message=f"stream {stream} has {replicas} replica(s): on a 3-node cluster "
                    f"raise it (`nats stream edit {stream} --replicas 3`; `jetfleet "
                    f"topology apply` does it for streams, not buckets) ({DOCS})",
                )
            )
    return found


async def read_sync(urls: list[str], timeout_s: float = _VARZ_TIMEOUT_S) -> list[ServerSync]:
    """Each server's sync setting from its ``/varz``."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        return list(await asyncio.gather(*(_varz_sync(http, url) for url in urls)))


async def _varz_sync(http: aiohttp.ClientSession, url: str) -> ServerSync:
    try:
        async with http.get(url + "/varz") as response:
            response.raise_for_status()
            varz = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return ServerSync(monitor_url=url, error=f"{type(exc).__name__}: {exc}")
    config = (varz.get("jetstream") or {}).get("config") or {}
    if not config:
        return ServerSync(monitor_url=url, error="JetStream is not enabled on this server")
    return ServerSync(
        monitor_url=url,
        server_name=str(varz.get("server_name", "")),
        sync_always=bool(config.get("sync_always", False)),
        sync_interval_s=float(config.get("sync_interval", 0)) / 1e9,
    )


def sync_findings(syncs: list[ServerSync]) -> list[Finding]:
    """Servers that do not sync every write, or whose setting could not be read."""
    found = []
    for sync in syncs:
        name = sync.server_name or sync.monitor_url
        if sync.sync_always is None:
            found.append(
                Finding(
                    code="sync-unreadable",
                    message=f"could not read the sync setting of {sync.monitor_url}/varz "
                    f"({sync.error}): fix nats.monitor_url or the server's http: port",
                )
            )
        elif not sync.sync_always:
            found.append(
                Finding(
                    code="sync-not-always",
                    message=f"server {name} syncs to disk every {sync.sync_interval_s:g} s "
                    f"and acknowledges writes before: set jetstream {{ sync_interval: "
                    f"always }} in its configuration ({DOCS})",
                )
            )
    return found


async def start_findings(settings: Settings) -> tuple[list[Finding], bool]:
    """What a service checks at start: the replicas setting and, where
    ``nats.monitor_url`` lists the servers, their sync. Returns the findings and
    whether the sync was checked."""
    found = replica_findings(settings)
    urls = monitor_urls(settings)
    if urls:
        found += sync_findings(await read_sync(urls))
    return found, bool(urls)


def start_line(findings: list[Finding], sync_checked: bool, dev: bool) -> str:
    """The one line a service logs at start ("" when there is nothing to say)."""
    if not findings:
        return ""
    codes = ", ".join(f.code for f in findings)
    if dev:
        return f"dev NATS ({codes}): fine for development, not a model for production ({DOCS})"
    unchecked = "" if sync_checked else "; sync not checked (set nats.monitor_url)"
    return "NATS below production durability: " + "; ".join(f.message for f in findings) + unchecked
