"""The simulated target's routes, middleware and shared state."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import secrets
import time
from collections import Counter
from email.utils import formatdate
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from jetfleet.simulator.config import SimulatorConfig
from jetfleet.simulator.counters import Pending, RequestCounters
from jetfleet.simulator.pages import (
    SHOP_TRAPS,
    big_html,
    blocked_html,
    challenge_html,
    error_html,
    missing_html,
    page_html,
    shop_item_html,
    shop_trap_html,
)

WORKER_HEADER = "X-Jetfleet-Worker"
SIM_PREFIX = "/__sim/"
# Route kind for requests no route matched (unknown paths, wrong methods).
OTHER_KIND = "other"
# Route kind of ``/ratelimited/N``, and of a request ``rate_limit_next`` answered 429.
RATELIMITED_KIND = "ratelimited"

DEFAULT_SLOW_DELAY_S = 1.0
MAX_SLOW_DELAY_S = 60.0
# A hung request must still end eventually so a forgotten client cannot pin a task forever.
HANG_CAP_S = 300.0
DEFAULT_RETRY_AFTER_S = 2
DEFAULT_BIG_BYTES = 3 * 1024 * 1024
MAX_BIG_BYTES = 64 * 1024 * 1024

# The cookie ``/session/N`` sets: a session token, the state an identity holds.
SESSION_COOKIE = "sim_session"

_CONFIG_KEYS = frozenset({"latency_s", "robots_txt", "robots_status"})


def client_id(request: web.Request) -> str:
    """Names the client of ``request``: worker header, else user agent, else address."""
    return (
        request.headers.get(WORKER_HEADER)
        or request.headers.get("User-Agent")
        or request.remote
        or "unknown"
    )


def parse_delay(raw: str | None) -> float:
    """Parses the ``delay`` query parameter of ``/slow``, capped at 60 s.

    Args:
        raw: The parameter as sent, or None when absent (1 s).

    Returns:
        The delay in seconds.

    Raises:
        ValueError: If it is not a finite number >= 0.
    """
    if raw is None:
        return DEFAULT_SLOW_DELAY_S
    delay = float(raw)
    if not math.isfinite(delay) or delay < 0:
        raise ValueError(f"delay must be a finite number >= 0, got {raw!r}")
    return min(delay, MAX_SLOW_DELAY_S)


def parse_retry_after(raw: str | None) -> int:
    """Parses the ``retry_after`` query parameter of ``/ratelimited``.

    Args:
        raw: The parameter as sent, or None when absent (2 s).

    Returns:
        Whole seconds, as ``Retry-After`` only allows an integer.

    Raises:
        ValueError: If it is not an integer >= 0.
    """
    if raw is None:
        return DEFAULT_RETRY_AFTER_S
    seconds = int(raw)
    if seconds < 0:
        raise ValueError(f"retry_after must be >= 0, got {raw!r}")
    return seconds


def parse_seconds(raw: str | None, name: str) -> float:
    """Parses a finite number of seconds (may be negative) from query parameter ``name``.

    Raises:
        ValueError: If it is not a finite number.
    """
    seconds = float(raw or 0)
    if not math.isfinite(seconds):
        raise ValueError(f"{name} must be a finite number of seconds, got {raw!r}")
    return seconds


def parse_times(raw: str | None) -> int | None:
    """Parses the ``times`` query parameter of ``/ratelimited`` and ``/error``.

    Returns:
        How many requests to the path fail before it answers its page; None when absent
        (every request fails).

    Raises:
        ValueError: If it is not an integer >= 0.
    """
    if raw is None:
        return None
    times = int(raw)
    if times < 0:
        raise ValueError(f"times must be >= 0, got {raw!r}")
    return times


def _rate_limit_headers(query: Any) -> dict[str, str]:
    """``Retry-After`` in delta-seconds (``retry_after``) or, with ``retry_at``, as an
    HTTP-date that many seconds after this answer's ``Date``; ``date_skew`` shifts both
    dates, as a target whose clock is off would send them."""
    if "retry_at" not in query:
        return {"Retry-After": str(parse_retry_after(query.get("retry_after")))}
    now = time.time() + parse_seconds(query.get("date_skew"), "date_skew")
    at = now + parse_seconds(query.get("retry_at"), "retry_at")
    return {"Date": formatdate(now, usegmt=True), "Retry-After": formatdate(at, usegmt=True)}


def _html(text: str, status: int = 200) -> web.Response:
    return web.Response(text=text, status=status, content_type="text/html")


def _bad_request(message: str) -> web.Response:
    return web.json_response({"error": message}, status=400)


def _with_optional_retry_after(request: web.Request, response: web.Response) -> web.Response:
    """Adds ``Retry-After`` only when the query asks for one (block pages often send none)."""
    raw = request.query.get("retry_after")
    if raw is None:
        return response
    try:
        response.headers["Retry-After"] = str(parse_retry_after(raw))
    except ValueError as exc:
        return _bad_request(str(exc))
    return response


def _page_number(request: web.Request) -> int:
    return int(request.match_info["n"])


class TargetRoutes:
    """Serves the simulated website and its ``/__sim`` control endpoints.

    Args:
        config: Initial knobs; latency can change later through ``set_latency``.
        counters: Where counted requests are recorded.
    """

    def __init__(self, config: SimulatorConfig, counters: RequestCounters) -> None:
        self._config = config
        self._counters = counters
        self._inflight: set[asyncio.Task[Any]] = set()
        self._hung: set[asyncio.Future[None]] = set()
        # Requests per path that asked ``times=``: the failures a path has given so far.
        # Only such paths are kept, so the map stays as small as the test's plan.
        self._asked_times: Counter[str] = Counter()
        self._next_retry_after: int | None = None
        # Session tokens issued by ``/session/N``, and what each such request brought.
        self.sessions_issued: list[str] = []
        self.sessions_presented: list[tuple[str, str]] = []
        # Sessions the site has flagged: ``/session/N`` challenges a request bearing one.
        self.challenged_sessions: set[str] = set()
        # When the scripted 429 storm (config.storm_s) began: at the first counted request.
        self._storm_began: float | None = None

    @property
    def config(self) -> SimulatorConfig:
        """The knobs in force now."""
        return self._config

    def set_latency(self, latency_s: float) -> None:
        """Changes the delay added to every counted request from now on.

        Raises:
            ValueError: If ``latency_s`` is not a finite number >= 0.
        """
        self._config = dataclasses.replace(self._config, latency_s=latency_s)

    def set_robots(self, text: str | None = None, status: int | None = None) -> None:
        """Changes what ``/robots.txt`` answers from now on (None keeps that part).

        Raises:
            ValueError: If ``status`` is not from 200 to 599.
        """
        changes: dict[str, Any] = {}
        if text is not None:
            changes["robots_txt"] = text
        if status is not None:
            changes["robots_status"] = status
        self._config = dataclasses.replace(self._config, **changes)

    def cancel_inflight(self) -> set[asyncio.Task[Any]]:
        """Cancels every counted request still being handled; returns their tasks.

        Shutdown would otherwise wait on ``/hang`` and ``/slow`` handlers; cancelling
        them drops their connections unanswered, as a dying server does.
        """
        tasks = set(self._inflight)
        for task in tasks:
            task.cancel()
        return tasks

    def reset(self) -> None:
        """Zeroes the counters and what ``times=`` paths have answered (they fail again)."""
        self._counters.reset()
        self._asked_times.clear()
        self.sessions_issued.clear()
        self.sessions_presented.clear()
        self.challenged_sessions.clear()
        self._storm_began = None

    def rate_limit_next(self, retry_after_s: int) -> None:
        """The next counted request, whatever its path, answers 429 with
        ``Retry-After: retry_after_s`` (counted as kind ``ratelimited``); later ones as
        usual. A slow-down that comes mid-run, from no job in particular.

        Raises:
            ValueError: If ``retry_after_s`` is negative.
        """
        if retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {retry_after_s!r}")
        self._next_retry_after = retry_after_s

    def _fails_now(self, request: web.Request) -> bool:
        """Whether this request to a failing route fails: always, or (with ``times=K``)
        only the first K requests to its path; later ones answer the page.

        Raises:
            ValueError: If ``times`` is not an integer >= 0.
        """
        times = parse_times(request.query.get("times"))
        if times is None:
            return True
        self._asked_times[request.path] += 1
        return self._asked_times[request.path] <= times

    def build_app(self) -> web.Application:
        """Builds the aiohttp application."""

        @web.middleware
        async def count_and_delay(request: web.Request, handler: Handler) -> web.StreamResponse:
            return await self._count_and_delay(request, handler)

        app = web.Application(middlewares=[count_and_delay])
        app.router.add_get("/page/{n:\\d+}", self._page, name="page")
        app.router.add_get("/missing/{n:\\d+}", self._missing, name="missing")
        app.router.add_get("/slow/{n:\\d+}", self._slow, name="slow")
        app.router.add_get("/hang/{n:\\d+}", self._hang, name="hang")
        app.router.add_get("/ratelimited/{n:\\d+}", self._ratelimited, name=RATELIMITED_KIND)
        app.router.add_get("/blocked/{n:\\d+}", self._blocked, name="blocked")
        app.router.add_get("/challenge/{n:\\d+}", self._challenge, name="challenge")
        app.router.add_get("/noselector/{n:\\d+}", self._noselector, name="noselector")
        app.router.add_get("/error/{n:\\d+}", self._error, name="error")
        app.router.add_get("/redirect/{n:\\d+}", self._redirect, name="redirect")
        app.router.add_get("/big/{n:\\d+}", self._big, name="big")
        app.router.add_get("/session/{n:\\d+}", self._session, name="session")
        app.router.add_get("/shop/item/{n:\\d+}", self._shop_item, name="shop-item")
        app.router.add_get("/shop/img/{n:\\d+}.png", self._shop_img, name="shop-img")
        app.router.add_get("/shop/trap/{name}/{n:\\d+}", self._shop_trap, name="shop-trap")
        app.router.add_get("/robots.txt", self._robots, name="robots")
        app.router.add_get(SIM_PREFIX + "counts", self._get_counts)
        app.router.add_post(SIM_PREFIX + "reset", self._reset)
        app.router.add_get(SIM_PREFIX + "config", self._get_config)
        app.router.add_post(SIM_PREFIX + "config", self._post_config)
        return app

    async def _count_and_delay(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith(SIM_PREFIX):
            return await handler(request)
        # Count on arrival, before any delay, so hung and slow requests show up at once.
        kind = request.match_info.route.name or OTHER_KIND
        retry_after, self._next_retry_after = self._next_retry_after, None
        if retry_after is None and kind != "robots":
            retry_after = self._storm_retry_after()
        if retry_after is not None:
            kind = RATELIMITED_KIND
        agent = request.headers.get("User-Agent", "")
        client = client_id(request)
        began = self._counters.now()
        self._counters.record(client, kind, agent, request.path)
        self._counters.began(kind)
        task = asyncio.current_task()
        token = id(task)
        self._counters.opened(token, Pending(client, began, request.path))
        if task is not None:
            self._inflight.add(task)
        try:
            if self._config.latency_s > 0:
                await asyncio.sleep(self._config.latency_s)
            if retry_after is not None:
                limited = _html(error_html(429), status=429)
                limited.headers["Retry-After"] = str(retry_after)
                return limited
            response = await handler(request)
            if 200 <= response.status < 300:
                self._counters.served(request.path)
            return response
        finally:
            self._counters.closed(token)
            self._counters.ended(kind)
            self._counters.visited(client, began, request.path)
            if task is not None:
                self._inflight.discard(task)

    # --- the scripted 429 storm (config.storm_s) ---------------------------------------

    def _storm_retry_after(self) -> int | None:
        """The storm's ``Retry-After`` while it lasts (None: no storm now). It begins at
        the first counted request, so it meets the fleet whenever the fleet arrives."""
        if self._config.storm_s <= 0:
            return None
        now = self._counters.now()
        if self._storm_began is None:
            self._storm_began = now
        if now - self._storm_began < self._config.storm_s:
            return self._config.storm_retry_after_s
        return None

    async def _page(self, request: web.Request) -> web.Response:
        n = _page_number(request)
        if n >= self._config.pages:
            return _html(missing_html(request.path), status=404)
        return _html(page_html(n, self._config.pages))

    async def _session(self, request: web.Request) -> web.Response:
        """A page that keeps a session: a request without a token it issued gets a new
        one as a cookie; one with it gets the page, or the challenge page if the session
        was flagged (``challenged_sessions``)."""
        n = _page_number(request)
        presented = request.cookies.get(SESSION_COOKIE, "")
        self.sessions_presented.append((request.path, presented))
        if presented in self.challenged_sessions:
            return _html(challenge_html(), status=503)
        response = _html(page_html(n, self._config.pages))
        if presented not in self.sessions_issued:
            token = secrets.token_hex(16)
            self.sessions_issued.append(token)
            response.set_cookie(SESSION_COOKIE, token, path="/", httponly=True)
        return response

    async def _shop_item(self, request: web.Request) -> web.Response:
        """A product page for browser jobs (``removed=1``: without ``.price``;
        ``delay=S``: answered S seconds late, at most 60)."""
        n = _page_number(request)
        try:
            delay = parse_delay(request.query.get("delay", "0"))
        except ValueError as exc:
            return _bad_request(str(exc))
        if delay:
            await asyncio.sleep(delay)
        if n >= self._config.pages:
            return _html(missing_html(request.path), status=404)
        removed = request.query.get("removed", "") not in ("", "0")
        return _html(shop_item_html(n, self._config.pages, removed=removed))

    async def _shop_trap(self, request: web.Request) -> web.Response:
        """A hostile page for browser jobs (``pages.shop_trap_html``)."""
        name = request.match_info["name"]
        if name not in SHOP_TRAPS:
            return _html(missing_html(request.path), status=404)
        n = min(_page_number(request), 1000)
        to = request.query.get("to", "")
        response = _html(shop_trap_html(name, n, to) if to else shop_trap_html(name, n))
        if name == "preconnect" and to:
            response.headers["Link"] = f"<{to}>; rel=preconnect"
        return response

    async def _shop_img(self, request: web.Request) -> web.Response:
        # A tiny image: a browser worker never asks for it (sub-resources are not sent).
        return web.Response(body=b"\x89PNG\r\n\x1a\n", content_type="image/png")

    async def _missing(self, request: web.Request) -> web.Response:
        return _html(missing_html(request.path), status=404)

    async def _slow(self, request: web.Request) -> web.Response:
        try:
            delay = parse_delay(request.query.get("delay"))
        except ValueError as exc:
            return _bad_request(str(exc))
        await asyncio.sleep(delay)
        return _html(page_html(_page_number(request), self._config.pages))

    async def _hang(self, request: web.Request) -> web.Response:
        released = asyncio.get_running_loop().create_future()
        self._hung.add(released)
        try:
            await asyncio.wait_for(released, HANG_CAP_S)
        except TimeoutError:
            pass
        finally:
            self._hung.discard(released)
        return _html(error_html(504), status=504)

    def release_hung(self) -> int:
        """Lets every ``/hang/N`` request waiting now answer its 504; how many."""
        hung, self._hung = self._hung, set()
        for released in hung:
            if not released.done():
                released.set_result(None)
        return len(hung)

    async def _ratelimited(self, request: web.Request) -> web.Response:
        try:
            headers = _rate_limit_headers(request.query)
            if not self._fails_now(request):
                return _html(page_html(_page_number(request), self._config.pages))
        except ValueError as exc:
            return _bad_request(str(exc))
        response = _html(error_html(429), status=429)
        response.headers.update(headers)
        return response

    async def _blocked(self, request: web.Request) -> web.Response:
        return self._refusal(request, _html(blocked_html(), status=403))

    async def _challenge(self, request: web.Request) -> web.Response:
        return self._refusal(request, _html(challenge_html(), status=503))

    def _refusal(self, request: web.Request, refusal: web.Response) -> web.Response:
        """A block or challenge page; with ``times=K`` only for the first K requests to
        its path (a refusal that stops, so a test can count exactly how many were met)."""
        try:
            if not self._fails_now(request):
                return _html(page_html(_page_number(request), self._config.pages))
        except ValueError as exc:
            return _bad_request(str(exc))
        return _with_optional_retry_after(request, refusal)

    async def _noselector(self, request: web.Request) -> web.Response:
        return _html(page_html(_page_number(request), self._config.pages, with_content=False))

    async def _error(self, request: web.Request) -> web.Response:
        try:
            if not self._fails_now(request):
                return _html(page_html(_page_number(request), self._config.pages))
        except ValueError as exc:
            return _bad_request(str(exc))
        return _html(error_html(500), status=500)

    async def _redirect(self, request: web.Request) -> web.Response:
        # Location exactly as given (relative or absolute, on this site or another).
        location = request.query.get("to", f"/page/{_page_number(request)}")
        return web.Response(status=302, headers={"Location": location})

    async def _big(self, request: web.Request) -> web.Response:
        try:
            size = int(request.query.get("bytes", DEFAULT_BIG_BYTES))
        except ValueError:
            return _bad_request("bytes must be a whole number")
        if not 0 <= size <= MAX_BIG_BYTES:
            return _bad_request(f"bytes must be from 0 to {MAX_BIG_BYTES}")
        body = big_html(_page_number(request), size)
        return web.Response(body=body, content_type="text/html", charset="utf-8")

    async def _robots(self, request: web.Request) -> web.Response:
        return web.Response(
            text=self._config.robots_txt,
            status=self._config.robots_status,
            content_type="text/plain",
        )

    async def _get_counts(self, request: web.Request) -> web.Response:
        return web.json_response(self._counters.snapshot())

    async def _reset(self, request: web.Request) -> web.Response:
        self.reset()
        return web.json_response(self._counters.snapshot())

    async def _get_config(self, request: web.Request) -> web.Response:
        return web.json_response(dataclasses.asdict(self._config))

    async def _post_config(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _bad_request("body must be JSON")
        if not isinstance(body, dict):
            return _bad_request("body must be a JSON object")
        unknown = set(body) - _CONFIG_KEYS
        if unknown:
            return _bad_request(f"unknown keys: {sorted(unknown)}")
        if "latency_s" in body:
            latency = body["latency_s"]
            # bool is an int subclass; "true" seconds is a client bug, not a latency.
            if isinstance(latency, bool) or not isinstance(latency, (int, float)):
                return _bad_request("latency_s must be a number")
            try:
                self.set_latency(float(latency))
            except ValueError as exc:
                return _bad_request(str(exc))
        return self._post_robots(body) or web.json_response(dataclasses.asdict(self._config))

    def _post_robots(self, body: dict[str, Any]) -> web.Response | None:
        """Apply the robots keys of a ``POST /__sim/config``; a 400 if one is bad."""
        text, status = body.get("robots_txt"), body.get("robots_status")
        if text is not None and not isinstance(text, str):
            return _bad_request("robots_txt must be a string")
        if status is not None and (isinstance(status, bool) or not isinstance(status, int)):
            return _bad_request("robots_status must be a whole number")
        try:
            self.set_robots(text, status)
        except ValueError as exc:
            return _bad_request(str(exc))
        return None
