"""Connecting to NATS the way every jetfleet process should."""

from __future__ import annotations

import logging

import nats
from nats.aio.client import Client as NatsClient

from jetfleet.errors import JetfleetError
from jetfleet.settings import NatsSettings

log = logging.getLogger(__name__)

# Per-message TTL (leases, idempotency keys) and consumer pause need 2.11.
MIN_NATS_VERSION = (2, 11, 0)


async def connect_nats(settings: NatsSettings, name: str) -> NatsClient:
    """Connect with settings fit for a long-running service.

    nats-py gives up reconnecting after about two minutes and pings only every 120 s by
    default; a service must keep trying and notice a dead server quickly.

    Raises:
        JetfleetError: if the server cannot be reached or is older than 2.11.
    """
    try:
        nc = await nats.connect(
            # A cluster is given as a comma-separated list of seed URLs.
            servers=[u.strip() for u in settings.url.split(",") if u.strip()],
            name=name,
            connect_timeout=settings.connect_timeout_s,
            ping_interval=settings.ping_interval_s,
            max_outstanding_pings=3,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            allow_reconnect=True,
            error_cb=_log_error,
        )
    except Exception as exc:  # nats-py raises several unrelated types here
        raise JetfleetError(
            f"cannot connect to NATS at {settings.url}: {exc}; start one (`jetfleet dev`) "
            "or set NATS_URL"
        ) from exc
    version = nc.connected_server_version
    if (version.major, version.minor) < MIN_NATS_VERSION[:2]:
        await nc.close()
        raise JetfleetError(
            f"NATS at {settings.url} is {version}; jetfleet needs nats-server >= 2.11 "
            "(per-message TTL, consumer pause): point NATS_URL at a newer server"
        )
    return nc


async def _log_error(exc: Exception) -> None:
    log.warning("nats connection error: %s", exc)
