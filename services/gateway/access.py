"""Who may call the gateway's routes.

Writes (POST) need the bearer token from ``gateway.token``; with no token configured they
are allowed only on a loopback listener, where every caller is already on the machine.
Reads beyond health (``/v1/status``, ``/metrics``, the dashboard's ``/v1/...`` reads)
need the token too once one is set, unless ``gateway.open_reads``; ``/healthz`` and the
dashboard page (static, no data) are always open.
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


def check_read(gateway: GatewaySettings, authorization: str | None) -> Denial | None:
    """Decide whether a read beyond health may go ahead.

    Args:
        gateway: the gateway settings (token, open_reads).
        authorization: the request's ``Authorization`` header, if any.

    Returns:
        None when allowed, else the 401 denial to answer with.
    """
    if not gateway.token or gateway.open_reads:
        return None
    return _check_token(gateway.token, authorization)


def _check_token(token: str, authorization: str | None) -> Denial | None:
    scheme, _, given = (authorization or "").partition(" ")
    # compare_digest: the time taken must not reveal how much of the token matched.
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
        return None
    return Denial(
        401,
        "this route needs the gateway token: send the header "
        "'Authorization: Bearer <token>' with the value of gateway.token",
    )


def check_write(gateway: GatewaySettings, authorization: str | None) -> Denial | None:
    """Decide whether a POST may go ahead.

    Args:
        gateway: the gateway settings (bind host and token).
        authorization: the request's ``Authorization`` header, if any.

    Returns:
        None when allowed, else the denial to answer with (401 or 403).
    """
    if gateway.token:
        return _check_token(gateway.token, authorization)
    if is_loopback(gateway.host):
        return None
    return Denial(
        403,
        f"writes are refused: the gateway listens on {gateway.host!r} (not loopback) and "
        "gateway.token is empty; set gateway.token (or JETFLEET_GATEWAY__TOKEN) and send "
        "'Authorization: Bearer <token>'",
    )
