"""Who may call the gateway's state-changing (POST) routes.

Reads (status, metrics, dashboard, health) are open. Writes need the bearer token from
``gateway.token``; with no token configured they are allowed only on a loopback
listener, where every caller is already on the machine.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass

from jetfleet.settings import GatewaySettings


@dataclass(frozen=True)
class Denial:
    """Why a write was refused: the HTTP status and what the caller should do."""

    status: int
    message: str


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the listener reachable from this machine only.

    Args:
        host: the configured bind host, e.g. ``127.0.0.1``, ``::1``, ``localhost``.
    """
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        # A hostname other than localhost (or "" / "0.0.0.0"-like) may resolve anywhere.
        return False


def check_write(gateway: GatewaySettings, authorization: str | None) -> Denial | None:
    """Decide whether a POST may go ahead.

    Args:
        gateway: the gateway settings (bind host and token).
        authorization: the request's ``Authorization`` header, if any.

    Returns:
        None when allowed, else the denial to answer with (401 or 403).
    """
    if gateway.token:
        scheme, _, given = (authorization or "").partition(" ")
        # compare_digest: the time taken must not reveal how much of the token matched.
        if scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), gateway.token.encode()
        ):
            return None
        return Denial(
            401,
            "this route needs the gateway token: send the header "
            "'Authorization: Bearer <token>' with the value of gateway.token",
        )
    if is_loopback(gateway.host):
        return None
    return Denial(
        403,
        f"writes are refused: the gateway listens on {gateway.host!r} (not loopback) and "
        "gateway.token is empty; set gateway.token (or JETFLEET_GATEWAY__TOKEN) and send "
        "'Authorization: Bearer <token>'",
    )
