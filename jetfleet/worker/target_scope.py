"""Where a worker may send a target's requests: under its ``base_url``, plus the hosts
its ``redirect_hosts`` lists for redirects.

Admission already refuses a job outside its target, but a work order can also come from
any NATS client straight onto ``jf.work.<target>.<tier>``, or outlive a change of the
target's ``base_url``: the worker checks again before the first request. A redirect off
the target is not followed: that site's caps, robots rules and owner's consent are not
the target's.
"""

from __future__ import annotations

from urllib.parse import urljoin, urlsplit

from jetfleet.canonical import is_under
from jetfleet.errors import PermanentFailure
from jetfleet.settings import TargetSettings

OUTSIDE_TARGET = "url-outside-target"
REDIRECT_OFF_TARGET = "redirect-off-target"


def job_outside_target(url: str, name: str, target: TargetSettings) -> str | None:
    """None when ``url`` lies under the target's ``base_url``; otherwise why not."""
    if is_under(url, target.base_url):
        return None
    return f"{url} is not under targets.{name}.base_url ({target.base_url}); nothing was sent"


def redirect_to(current: str, location: str, target: TargetSettings) -> str:
    """The absolute URL a redirect from ``current`` to ``location`` leads to, when the
    target allows it: under its ``base_url``, or on a host in its ``redirect_hosts``.

    Raises:
        PermanentFailure: ``redirect-off-target`` otherwise (nothing is sent there).
    """
    url = urljoin(current, location)
    if is_under(url, target.base_url) or listed_host(url, target.redirect_hosts):
        return url
    raise PermanentFailure(
        REDIRECT_OFF_TARGET,
        detail=f"{current} redirects to {url}, outside the target; not followed (list its "
        "host in the target's redirect_hosts to allow it)",
    )


def listed_host(url: str, hosts: tuple[str, ...]) -> bool:
    """Whether ``url`` is http(s) on one of ``hosts`` (``host`` or ``host:port``)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # a port that is not a number: no listed host matches it
        return False
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False
    host = parts.hostname.lower()
    with_port = f"{host}:{port}" if port else host
    return host in hosts or with_port in hosts
