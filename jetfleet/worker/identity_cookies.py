"""An identity's cookie jar: its session state, which never leaves its worker.

Kept in memory, and with the identity's ``state_dir`` also in ``cookies.json`` there
(readable by this user only), loaded at start and saved at drain and whenever cookies
are discarded. Nothing of it is put in a job, result, outcome, dead letter, report or
log line (DESIGN I5). A failed challenge discards the cookies the jar would send to that
target; the job is requeued, never the cookies (docs/identities.md).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from jetfleet.settings import TargetSettings

log = logging.getLogger(__name__)

COOKIES_FILE = "cookies.json"


class IdentityCookies:
    """The cookie jar of the identity a worker owns (or of a worker without one)."""

    def __init__(self, identity: str, state_dir: str = "") -> None:
        self.identity = identity
        # unsafe: keep cookies of targets addressed by IP (an operator's own hosts), as
        # of any other; aiohttp drops them by default.
        self.jar = aiohttp.CookieJar(unsafe=True)
        self.path = Path(state_dir) / COOKIES_FILE if state_dir else None

    def load(self) -> None:
        """Read the jar kept in ``state_dir``, if any. One that cannot be read is left
        (and overwritten at the next save): session state is disposable."""
        if self.path is None or not self.path.exists():
            return
        try:
            self.jar.load(self.path)
        except Exception as exc:
            log.warning(
                "cookies of identity %s not loaded from %s (%s); starting without",
                self.identity,
                self.path,
                type(exc).__name__,
            )

    def save(self) -> None:
        """Write the jar to ``state_dir`` (nothing without one), replacing the file whole
        so a crash mid-write leaves the old jar, not half of one."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        part = self.path.with_name(self.path.name + ".part")
        self.jar.save(part)
        os.chmod(part, 0o600)
        os.replace(part, self.path)

    def discard_for(self, target: TargetSettings) -> int:
        """Drop every cookie the jar would send to ``target`` (its base URL's host and
        its redirect hosts), and save; how many were dropped."""
        hosts = {urlsplit(target.base_url).hostname or ""}
        hosts |= {h.split(":", 1)[0] for h in target.redirect_hosts}  # host or host:port
        hosts.discard("")
        before = len(self.jar)
        self.jar.clear(lambda morsel: any(_sent_to(morsel["domain"], h) for h in hosts))
        dropped = before - len(self.jar)
        try:
            self.save()  # a crash now must not bring the dead session back
        except OSError as exc:
            log.warning("cookies of identity %s not saved: %s", self.identity, exc)
        return dropped


def _sent_to(cookie_domain: str, host: str) -> bool:
    """Whether a cookie of ``cookie_domain`` goes with requests to ``host`` (RFC 6265
    domain matching)."""
    domain = cookie_domain.lstrip(".").lower()
    host = host.lower()
    return bool(domain) and (host == domain or host.endswith("." + domain))
