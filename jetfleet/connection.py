"""Connecting to NATS the way every jetfleet process should."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote, urlsplit

from nats.aio.client import Client as NatsClient

from jetfleet.auth.credentials import RoleCredentials, load_credentials, without_secrets
from jetfleet.auth.roles import Role, inbox_family
from jetfleet.coalescing_client import CoalescingClient
from jetfleet.errors import JetfleetError
from jetfleet.settings import NatsSettings

log = logging.getLogger(__name__)

# Per-message TTL (leases, idempotency keys) and consumer pause need 2.11.
MIN_NATS_VERSION = (2, 11, 0)


async def connect_nats(settings: NatsSettings, name: str, role: Role = "admin") -> NatsClient:
    """Connect with settings fit for a long-running service, as ``role``.

    nats-py gives up reconnecting after about two minutes and pings only every 120 s by
    default; a service must keep trying and notice a dead server quickly.

    With ``nats.credentials`` set, the connection presents ``role``'s credentials and
    takes its inboxes under the role's own family (``_INBOX_<role>.<name>.``), the only
    inboxes the role may subscribe to. Without it (a user-run server with no auth), the
    connection is anonymous and ``role`` only names it in logs.

    Args:
        settings: where NATS is, and the credentials setting.
        name: the connection's name (shown by the server, used in the inbox prefix).
        role: the role this process runs as (jetfleet/auth/roles.py); production code
            always names it, the default serves the tests' own connections.

    Raises:
        JetfleetError: if the server cannot be reached, refuses the credentials, or is
            older than 2.11.
    """
    credentials = load_credentials(settings.credentials, role)
    refused = asyncio.Event()
    nc = CoalescingClient()
    # A cluster is given as a comma-separated list of seed URLs.
    servers = [u.strip() for u in settings.url.split(",") if u.strip()]
    # nats-py annotates the timeouts as int, but takes seconds as floats (as nats.connect's
    # untyped **options passed them before).
    options: dict[str, Any] = {
        "servers": servers,
        "name": name,
        "connect_timeout": settings.connect_timeout_s,
        "ping_interval": settings.ping_interval_s,
        "max_outstanding_pings": 3,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "allow_reconnect": True,
        "error_cb": _error_logger(role, name, refused),
        **(
            _auth_options(credentials, role, name)
            if credentials is not None
            else _url_auth(servers)
        ),
    }
    connecting = asyncio.ensure_future(nc.connect(**options))
    # nats-py retries refused credentials forever (max_reconnect_attempts=-1): stop at
    # the first refusal, the credentials will not get better by themselves.
    waiting = asyncio.ensure_future(refused.wait())
    await asyncio.wait({connecting, waiting}, return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    if not connecting.done():
        connecting.cancel()
        with contextlib.suppress(BaseException):
            await connecting
        raise JetfleetError(
            f"NATS at {without_secrets(settings.url)} refused the {role!r} credentials"
            + (f" from {settings.credentials}" if settings.credentials else " (none given)")
            + ": they are not the server's (regenerated with `jetfleet auth init --force`?); "
            "give the server and the process one bundle, or set nats.credentials"
        )
    try:
        connecting.result()
    except Exception as exc:  # nats-py raises several unrelated types here
        raise JetfleetError(
            f"cannot connect to NATS at {without_secrets(settings.url)}: {exc}; start one "
            "(`jetfleet dev`) or set NATS_URL"
        ) from exc
    version = nc.connected_server_version
    if (version.major, version.minor) < MIN_NATS_VERSION[:2]:
        await nc.close()
        raise JetfleetError(
            f"NATS at {without_secrets(settings.url)} is {version}; jetfleet needs "
            "nats-server >= 2.11 (per-message TTL, consumer pause): point NATS_URL at a "
            "newer server"
        )
    return nc


def _auth_options(credentials: RoleCredentials | None, role: Role, name: str) -> dict[str, Any]:
    if credentials is None:
        return {}
    options: dict[str, Any] = {"inbox_prefix": inbox_prefix(role, name)}
    if credentials.nats_nkey_seed:
        options["nkeys_seed_str"] = credentials.nats_nkey_seed
    else:
        options["user"] = credentials.nats_user
        options["password"] = credentials.nats_password
    return options


def _url_auth(servers: list[str]) -> dict[str, Any]:
    """The user and password that the seed URLs carry, as connection-wide options.

    nats-py uses a URL's user only when connecting to that very URL: servers it learns
    from the cluster (``connect_urls``) are added without one, and a reconnect to them is
    refused ("Authorization Violation") until it happens to pick a seed again. Given as
    options, the user is presented to every server. Seeds with different users are left
    as they are (each seed then uses its own).
    """
    found = {(p.username, p.password) for p in map(urlsplit, servers) if p.username}
    if len(found) != 1 or any(not urlsplit(u).username for u in servers):
        return {}
    ((user, password),) = found
    assert user is not None
    if password is None:  # nats://TOKEN@host is a token, as nats-py reads it
        return {"token": unquote(user)}
    return {"user": unquote(user), "password": unquote(password)}


def inbox_prefix(role: Role, name: str) -> str:
    """The inbox prefix of connection ``name`` of ``role``: under the role's family, with
    the name as one token, so each connection (each worker) has inboxes of its own."""
    token = re.sub(r"[^A-Za-z0-9_-]", "_", name) or "conn"
    return f"{inbox_family(role)}.{token}"


_VIOLATION = re.compile(r"permissions violation for (publish|subscription) to \"?([^\"']+)")


def permission_violation(exc: BaseException) -> tuple[str, str] | None:
    """``(action, subject)`` when ``exc`` is the server refusing a subject, else None.

    nats-py hands these to ``error_cb`` only, lowercased (the subject too), and the call
    itself gets no error: a refused publish returns normally, a JetStream call times out.
    """
    match = _VIOLATION.search(str(exc).lower())
    return (match.group(1), match.group(2)) if match else None


def _error_logger(
    role: Role, name: str, refused: asyncio.Event
) -> Callable[[Exception], Awaitable[None]]:
    async def log_error(exc: Exception) -> None:
        if "authorization violation" in str(exc).lower():
            refused.set()
            log.error(
                "NATS refused the credentials of role %s (connection %s): %s", role, name, exc
            )
            return
        violation = permission_violation(exc)
        if violation is not None:
            action, subject = violation
            log.error(
                "NATS refused %s to %r for role %s (connection %s): the role lacks that "
                "subject (jetfleet/auth/roles.py); the subject is shown lowercased",
                action,
                subject,
                role,
                name,
            )
            return
        log.warning("nats connection error (role %s, connection %s): %s", role, name, exc)

    return log_error
