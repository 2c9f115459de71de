"""An identity's cookie jar: its session state, which never leaves its worker.

Kept in memory, and with the identity's ``state_dir`` also in ``cookies.json`` there
(readable by this user only), loaded at start and saved at drain and whenever cookies
are discarded. Nothing of it is put in a job, result, outcome, dead letter, report or
log line (DESIGN I5). A failed challenge discards the cookies the jar would send to that
target (by host and path); the job is requeued, never the cookies (docs/identities.md).
"""

from __future__ import annotations

import logging
import os
from http.cookies import Morsel
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
        so a crash mid-write leaves the old jar, not half of one. aiohttp (>= 3.14.1, the
        floor in pyproject) writes JSON: a pickle read back from a writable folder could
        run code."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        part = self.path.with_name(self.path.name + ".part")
        self.jar.save(part)
        os.chmod(part, 0o600)  # (a .part left by a crash keeps the mode it had)
        _fsync(part, os.O_RDONLY)
        os.replace(part, self.path)
        _fsync(self.path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))

    def discard_for(self, target: TargetSettings) -> int:
        """Drop every cookie the jar would send to ``target`` (a URL under its base URL,
        or any URL on its redirect hosts), and save; how many were dropped. A cookie of
        the same host scoped to another target's path is kept."""
        base = urlsplit(target.base_url)
        base_host = base.hostname or ""
        base_path = base.path or "/"
        hosts = {h.split(":", 1)[0] for h in target.redirect_hosts}  # host or host:port
        hosts.discard("")

        def sent_to_target(morsel: Morsel[str]) -> bool:
            domain = morsel["domain"]
            if any(_sent_to(domain, h) for h in hosts):
                return True
            path = morsel["path"] or "/"
            return (
                bool(base_host) and _sent_to(domain, base_host) and _path_overlaps(path, base_path)
            )

        before = len(self.jar)
        self.jar.clear(sent_to_target)
        dropped = before - len(self.jar)
        try:
            self.save()  # a crash now must not bring the dead session back
        except OSError as exc:
            log.warning("cookies of identity %s not saved: %s", self.identity, exc)
        return dropped


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sent_to(cookie_domain: str, host: str) -> bool:
    """Whether a cookie of ``cookie_domain`` goes with requests to ``host`` (RFC 6265
    domain matching)."""
    domain = cookie_domain.lstrip(".").lower()
    host = host.lower()
    return bool(domain) and (host == domain or host.endswith("." + domain))


def _path_matches(request_path: str, cookie_path: str) -> bool:
    """RFC 6265 5.1.4: whether a cookie of ``cookie_path`` goes with ``request_path``."""
    if request_path == cookie_path:
        return True
    return request_path.startswith(cookie_path) and (
        cookie_path.endswith("/") or request_path[len(cookie_path)] == "/"
    )


def _path_overlaps(cookie_path: str, base_path: str) -> bool:
    """Whether a cookie of ``cookie_path`` goes with some request under ``base_path``:
    it covers the base path itself, or lies under it."""
    return _path_matches(base_path, cookie_path) or cookie_path.startswith(base_path)
