"""One persistent Chromium context per identity, on a profile folder of this worker's own.

An identity's profile (cookies, localStorage, cache) lives in
``<worker.browser.profiles_dir>/<worker id>/<identity>``: never uploaded, never put in a
job or result (DESIGN I5), never shared by two identities (each name maps to its own
folder, with a hash so two names never meet in one), and never used by a second worker
process (the worker id is in the path, and Chromium itself refuses a second browser on a
profile in use). Contexts are reused by the jobs of their identity, at most
``max_contexts`` open (the least recently used idle one is closed to make room), and all
closed at the worker's drain.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from playwright.async_api import BrowserContext, Playwright, Route, async_playwright

from jetfleet.settings import BrowserSettings

log = logging.getLogger(__name__)

NO_IDENTITY = "_no-identity"
NO_NETWORK_PROXY = "http://127.0.0.1:1"
"""Where Chromium's own connections go (port 1 on loopback: nothing serves it, so each
is refused at once)."""
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def folder_name(name: str) -> str:
    """A folder name for a worker id or identity: readable, and its own (the hash keeps
    ``a/b`` and ``a_b`` apart)."""
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    return f"{_UNSAFE.sub('_', name)[:64].strip('.') or 'x'}-{digest}"


def profile_folder(profiles_dir: str, worker_id: str, identity: str) -> Path:
    """Where ``worker_id`` keeps ``identity``'s browser profile."""
    root = Path(profiles_dir).expanduser()
    return root / folder_name(worker_id) / folder_name(identity or NO_IDENTITY)


async def _abort(route: Route) -> None:
    await route.abort()


@dataclass
class _Open:
    context: BrowserContext
    users: int = 0


class BrowserContexts:
    """The open browser contexts of one worker, by identity."""

    def __init__(
        self, settings: BrowserSettings, executable: str, worker_id: str, user_agent: str
    ) -> None:
        self.settings = settings
        self.executable = executable
        self.worker_id = worker_id
        self.user_agent = user_agent
        self._playwright: Playwright | None = None
        self._open: OrderedDict[str, _Open] = OrderedDict()
        self._lock = asyncio.Lock()
        self.version = ""
        """The browser's version as the running Chromium reports it (once one opened)."""

    def folder(self, identity: str) -> Path:
        """The profile folder of ``identity`` in this worker."""
        return profile_folder(self.settings.profiles_dir, self.worker_id, identity)

    def open_identities(self) -> tuple[str, ...]:
        """Identities with a context open now, least recently used first."""
        return tuple(self._open)

    async def acquire(self, identity: str) -> BrowserContext:
        """The context of ``identity`` (opened on first use), marked in use until
        ``release``."""
        async with self._lock:
            held = self._open.get(identity)
            if held is None:
                await self._make_room()
                held = _Open(await self._launch(identity))
                self._open[identity] = held
            self._open.move_to_end(identity)
            held.users += 1
            return held.context

    def release(self, identity: str, context: BrowserContext | None = None) -> None:
        """One job of ``identity`` is done with its context (``context``, the one it
        acquired: when that one died meanwhile and another was opened for the identity,
        the new one's jobs are not the releasing job's, and it stays in use)."""
        held = self._open.get(identity)
        if held is not None and (context is None or held.context is context):
            held.users = max(0, held.users - 1)

    async def close(self) -> None:
        """Close every context and the driver (the worker drains)."""
        async with self._lock:
            while self._open:
                identity, held = self._open.popitem(last=False)
                await self._close_one(identity, held)
            if self._playwright is not None:
                await self._playwright.stop()
                self._playwright = None

    def _forget(self, identity: str, context: BrowserContext) -> None:
        held = self._open.get(identity)
        if held is not None and held.context is context:
            del self._open[identity]

    async def _make_room(self) -> None:
        while len(self._open) >= self.settings.max_contexts:
            idle = next((i for i, held in self._open.items() if held.users == 0), None)
            if idle is None:
                # Every one is in use by a running job: one over the cap for a while,
                # rather than a job's page closed under it.
                log.warning(
                    "worker %s: %d browser contexts in use, over worker.browser.max_contexts",
                    self.worker_id,
                    len(self._open),
                )
                return
            await self._close_one(idle, self._open.pop(idle))

    async def _launch(self, identity: str) -> BrowserContext:
        if self._playwright is None:
            self._playwright = await async_playwright().start()
        folder = self.folder(identity)
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o700)  # session state: this user's only
        context = await self._playwright.chromium.launch_persistent_context(
            str(folder),
            executable_path=self.executable,
            headless=True,
            # The identifying User-Agent, as http.get sends: never a browser's own.
            user_agent=self.user_agent,
            # A service worker's requests would pass by the routes that apply manners.
            service_workers="block",
            accept_downloads=False,
            # Chromium itself reaches no network: only the handler's document request
            # (route.fetch, sent by Playwright's driver, not by Chromium) leaves, with
            # its manners. A proxy nothing answers takes whatever Chromium would send on
            # its own, past the page's policy and routes (preconnect hints, DNS
            # prefetch): refused on this host, loopback included.
            args=[f"--proxy-server={NO_NETWORK_PROXY}", "--proxy-bypass-list=<-loopback>"],
        )
        # Beneath every page's own route: a request no page route answers (a page
        # closing, a popup, a frame of none of the jobs) is aborted, never sent.
        await context.route("**/*", _abort)
        if context.browser is not None:
            self.version = context.browser.version
        # A browser that dies (crash, killed) closes its context: forget it, so the next
        # job of the identity opens it again instead of failing on a dead one.
        context.on("close", lambda closed: self._forget(identity, closed))
        log.info(
            "worker %s opened a browser context for identity %s (Chromium %s)",
            self.worker_id,
            identity or "(none)",
            self.version or "?",
        )
        return context

    async def _close_one(self, identity: str, held: _Open) -> None:
        try:
            await held.context.close()
        except Exception as exc:  # a crashed browser is closed already
            log.warning("browser context of identity %s did not close: %r", identity, exc)
