"""Who may call the gateway's routes.

Writes (POST) need the bearer token from ``gateway.token``; with no token configured they
are allowed only on a loopback listener, where every caller is already on the machine.
Reads beyond health (``/v1/status``, ``/metrics``, the dashboard's ``/v1/...`` reads)
need the token too once one is set, unless ``gateway.open_reads``; ``/healthz`` and the
dashboard page (static, no data) are always open.

A tokenless loopback gateway answers reads and writes only to requests addressed to it by
a loopback name (``Host`` ``localhost``, ``127.0.0.1``, ``[::1]``), and a loopback
gateway's open reads are open only to those: a web page whose own name an attacker
rebinds to 127.0.0.1 (DNS rebinding) is same-origin to the browser, so only its ``Host``
header gives it away.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

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


def _host_name(host_header: str) -> str:
    """The name in a ``Host`` header, without its port (``[::1]:80`` -> ``::1``)."""
    if host_header.startswith("["):
        return host_header[1 : host_header.find("]")] if "]" in host_header else host_header
    return host_header.rpartition(":")[0] if ":" in host_header else host_header


def _check_loopback_host(host_header: str | None) -> Denial | None:
    if host_header is not None and is_loopback(_host_name(host_header)):
        return None
    return Denial(
        403,
        f"this gateway has no token and answers only requests addressed to a loopback "
        f"name (Host localhost, 127.0.0.1 or [::1]), not {host_header!r}: open it by one, "
        "or set gateway.token",
    )


def check_read(
    gateway: GatewaySettings, authorization: str | None, host_header: str | None = None
) -> Denial | None:
    """Decide whether a read beyond health may go ahead.

    Args:
        gateway: the gateway settings (token, open_reads, bind host).
        authorization: the request's ``Authorization`` header, if any.
        host_header: the request's ``Host`` header (checked on a tokenless loopback
            gateway only).

    Returns:
        None when allowed, else the denial to answer with (401, or 403 for a
        tokenless loopback gateway addressed by another name). With ``open_reads`` on a
        loopback gateway, a request addressed by another name needs the token (401).
    """
    loopback = is_loopback(gateway.host)
    if not gateway.token:
        return _check_loopback_host(host_header) if loopback else None
    # Open reads on a loopback gateway are open to requests addressed by a loopback name
    # only; any other (a rebound page, a proxy) is asked for the token.
    if gateway.open_reads and (not loopback or _check_loopback_host(host_header) is None):
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


def check_origin(origin: str | None, host_header: str | None) -> Denial | None:
    """Refuse a POST a page of another site made the operator's browser send.

    A cross-site form or ``fetch`` reaches a loopback gateway too, and a browser names
    its page's origin in ``Origin``; API clients (curl, the CLI) send none.

    Args:
        origin: the request's ``Origin`` header, if any.
        host_header: the request's ``Host`` header.

    Returns:
        None when there is no ``Origin`` or it is the gateway's own, else a 403 denial.
    """
    if origin is None or urlsplit(origin).netloc == (host_header or ""):
        return None
    return Denial(
        403,
        f"a POST from another origin ({origin}) is refused: use the dashboard the gateway "
        "serves, or send no Origin header",
    )


def check_write(
    gateway: GatewaySettings, authorization: str | None, host_header: str | None = None
) -> Denial | None:
    """Decide whether a POST may go ahead.

    Args:
        gateway: the gateway settings (bind host and token).
        authorization: the request's ``Authorization`` header, if any.
        host_header: the request's ``Host`` header (checked on a tokenless loopback
            gateway only; None there is refused).

    Returns:
        None when allowed, else the denial to answer with (401 or 403).
    """
    if gateway.token:
        return _check_token(gateway.token, authorization)
    if is_loopback(gateway.host):
        return _check_loopback_host(host_header)
    return Denial(
        403,
        f"writes are refused: the gateway listens on {gateway.host!r} (not loopback) and "
        "gateway.token is empty; set gateway.token (or JETFLEET_GATEWAY__TOKEN) and send "
        "'Authorization: Bearer <token>'",
    )
